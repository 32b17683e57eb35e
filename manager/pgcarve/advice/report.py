"""An advice run's report: a terminal summary and a self-contained HTML page (inline SVG plots,
no network fetches), both from the JSON document that advisor.run_advice returns."""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

from pgcarve.advice.measure import mean_cpu
from pgcarve.postgres.statistics import WAIT_CATEGORIES

WAIT_COLOURS = dict(zip(WAIT_CATEGORIES, ("#c0392b", "#e67e22", "#f1c40f", "#8e44ad", "#16a085", "#7f8c8d",
                                          "#2c3e50", "#bdc3c7", "#27ae60", "#95a5a6"), strict=True))
WORD_COLOURS = {"helps": "#1e8449", "does not help": "#922b21", "inconclusive": "#9a7d0a", "none": "#555"}


def case_rows(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per case, in the plan's order: figures a table or a plot shows."""
    order = [key for group in doc.get("plan", {}).get("cases", []) for key in group["cases"]]
    cases: Mapping[str, Any] = doc.get("cases", {})
    rows = []
    for key in [*order, *(k for k in cases if k not in order)]:
        case = cases.get(key)
        if case is None:
            continue
        guests = case.get("guests", {})
        rows.append({
            "case": key, "error": case.get("error"), "tps": case.get("aggregate_tps"),
            "runs": case.get("runs_tps") or ([case["aggregate_tps"]] if case.get("aggregate_tps") else []),
            "spread": case.get("spread"), "p50": case.get("latency_p50_ms"), "p99": case.get("latency_p99_ms"),
            "guests": len(guests), "vcpus": sum(g.get("vcpus", 0) for g in guests.values()),
            "guest_cpu": mean_cpu(list((case.get("guest_cpu") or {}).values())), "host_cpu": case.get("host_cpu"),
            "waits": (case.get("waits") or {}).get("shares", {}),
            "top_wait": _top(case.get("waits") or {}), "failed_runs": case.get("failed_runs", []),
        })
    return rows


def _top(waits: Mapping[str, Any]) -> str:
    shares = waits.get("shares") or {}
    if not waits.get("sessions") or not shares:
        return "-"
    top = max(shares, key=lambda c: shares[c])
    return f"{top} {shares[top] * 100:.0f}%"


def _split(cpu: Mapping[str, float] | None) -> str:
    if not cpu:
        return "-"
    return f"{cpu['user'] * 100:.0f}/{cpu['system'] * 100:.0f}/{cpu['idle'] * 100:.0f}"


def versions_line(doc: Mapping[str, Any]) -> str:
    """The versions a verdict holds for: guest kernel and PostgreSQL, host kernel, QEMU, libvirt."""
    v = doc.get("versions", {})
    guest, host, image = v.get("guest", {}), v.get("host", {}), v.get("image", {})
    kernel = guest.get("kernel", "")
    kernel = kernel.split()[2] if kernel.startswith("Linux version") else (kernel or image.get("kernel", "?"))
    libvirt = v.get("libvirt", {})
    # "PostgreSQL 15.20 (Debian ...) on x86_64-pc-linux-gnu, compiled by ...": the first two words
    postgresql = " ".join((guest.get("postgresql") or f"PostgreSQL {image.get('postgresql', '?')}").split()[:2])
    parts = [f"guest kernel {kernel}", f"guest {postgresql}",
             f"host kernel {host.get('kernel', '?')}"]
    if host.get("qemu"):  # "QEMU emulator version 7.2.22 (Debian ...)"
        words = host["qemu"].split()
        parts.append(f"QEMU {words[3]}" if len(words) > 3 and words[:3] == ["QEMU", "emulator", "version"]
                     else host["qemu"])
    if libvirt.get("libvirt"):
        parts.append(f"libvirt {libvirt['libvirt']}")
    return "; ".join(parts)


def profile_line(doc: Mapping[str, Any]) -> str | None:
    """The host kernel's hottest symbols during the single instance's run (advice/profile.py), in
    one line; None when that case did not run."""
    single = (doc.get("cases") or {}).get("single") or {}
    profile = single.get("kernel_profile")
    if profile is None:
        return None
    if not profile.get("available"):
        return f"host kernel profile: not taken ({profile.get('why', 'unknown reason')})"
    symbols = ", ".join(f"{s['symbol']} {s['share']:.1f} %" for s in profile.get("symbols", [])[:8]) or "no samples"
    return (f"hottest kernel symbols during the single instance, seen from {profile.get('seen_from')} "
            f"(perf {profile.get('event')}, {profile.get('samples') or '?'} samples): {symbols}")


def kept_line(kept: Sequence[str]) -> str:
    """"h0: volume X added" lines as "3 volume(s) of the guest image on h0, h1"."""
    hosts = sorted({line.split(":", 1)[0] for line in kept})
    return f"{len(kept)} volume(s) of the guest image on {', '.join(hosts)}"


def render_text(doc: Mapping[str, Any]) -> str:
    """The terminal summary."""
    plan, verdict = doc.get("plan", {}), doc.get("verdict", {})
    types = sorted(set((doc.get("domain_types") or {}).values()))
    lines = [f"pgcarve advise: host {plan.get('host')}, standbys on {', '.join(plan.get('standby_hosts', []))}, "
             f"guests of {plan.get('vcpus_per_guest')} vCPU, domain type {', '.join(types) or '?'}",
             f"versions: {versions_line(doc)}"]
    load = doc.get("load", {})
    if load:
        ramp = doc.get("ramp")
        how = (" (ramp: " + ", ".join(f"{s['clients']}: {s['tps']:,.0f}" for s in ramp["steps"]) + " TPS)") if ramp \
            else ""
        lines.append(f"load: {load.get('script')} - {load.get('clients')} clients{how}, {load.get('seconds')} s per "
                     f"run, {plan.get('repeat')} round(s)")
    header = f"{'case':<16} {'guests':>6} {'vCPUs':>5} {'TPS':>10} {'runs':<28} {'p50 ms':>7} {'p99 ms':>7} " \
             f"{'guest u/s/idle %':>16} {'host u/s/idle %':>15}  top wait"
    lines += ["", header, "-" * len(header)]
    for r in case_rows(doc):
        if r["error"]:
            lines.append(f"{r['case']:<16} failed: {r['error']}")
            continue
        runs = ", ".join(f"{t:,.0f}" for t in r["runs"])
        lines.append(f"{r['case']:<16} {r['guests']:>6} {r['vcpus']:>5} {r['tps'] or 0:>10,.0f} {runs:<28.28} "
                     f"{r['p50'] or 0:>7.2f} {r['p99'] or 0:>7.2f} {_split(r['guest_cpu']):>16} "
                     f"{_split(r['host_cpu']):>15}  {r['top_wait']}")
    profile = profile_line(doc)
    if profile:
        lines += ["", profile]
    lines += ["", f"verdict: {verdict.get('headline', 'none')}", f"why: {verdict.get('reason', '')}",
              f"figures: {verdict.get('figures', '')}"]
    if verdict.get("caveat"):
        lines.append(f"caveat: {verdict['caveat']}")
    if "host_left_as_it_was" in doc:
        kept = f" (kept for the next run: {kept_line(doc['kept'])})" if doc.get("kept") else ""
        lines.append("host left as it was: " + ("yes" + kept if doc["host_left_as_it_was"]
                                                 else "NO: " + "; ".join(doc.get("left_behind", []))))
    return "\n".join(lines)


# -- HTML ------------------------------------------------------------------------------------------


def _svg_tps(rows: Sequence[Mapping[str, Any]]) -> str:
    """Median TPS per case as bars, every run as a dot."""
    good = [r for r in rows if r["runs"]]
    if not good:
        return "<p>no case finished</p>"
    top = max(max(r["runs"]) for r in good) or 1.0
    bar, gap, height, left = 56, 24, 220, 70
    width = left + len(good) * (bar + gap) + gap
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + 60}" role="img" '
             'aria-label="TPS per case">']
    for k in range(5):
        y = 10 + height - height * k / 4
        parts.append(f'<line x1="{left}" x2="{width}" y1="{y:.0f}" y2="{y:.0f}" stroke="#ddd"/>'
                     f'<text x="{left - 6}" y="{y + 4:.0f}" text-anchor="end" font-size="11">{top * k / 4:,.0f}</text>')
    for i, r in enumerate(good):
        x = left + gap + i * (bar + gap)
        h = height * (r["tps"] or 0) / top
        parts.append(f'<rect x="{x}" y="{10 + height - h:.1f}" width="{bar}" height="{h:.1f}" fill="#3b6ea8">'
                     f'<title>{html.escape(r["case"])}: median {r["tps"]:,.1f} TPS</title></rect>')
        for t in r["runs"]:
            parts.append(f'<circle cx="{x + bar / 2}" cy="{10 + height - height * t / top:.1f}" r="3" fill="#111"/>')
        parts.append(f'<text x="{x + bar / 2}" y="{height + 28}" text-anchor="middle" font-size="11">'
                     f'{html.escape(r["case"])}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _svg_waits(rows: Sequence[Mapping[str, Any]]) -> str:
    """Each case's client-session time by wait category, as one stacked bar."""
    good = [r for r in rows if r["waits"]]
    if not good:
        return "<p>no wait samples</p>"
    width, left, row_h = 640, 120, 24
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + 20}" height="{len(good) * row_h + 40}" '
             'role="img" aria-label="wait events per case">']
    for i, r in enumerate(good):
        y, x = 6 + i * row_h, float(left)
        parts.append(f'<text x="{left - 6}" y="{y + 15}" text-anchor="end" font-size="11">'
                     f'{html.escape(r["case"])}</text>')
        for cat in WAIT_CATEGORIES:
            share = float(r["waits"].get(cat, 0.0))
            if share <= 0:
                continue
            w = (width - left) * share
            parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row_h - 6}" fill="{WAIT_COLOURS[cat]}">'
                         f'<title>{html.escape(r["case"])}: {cat} {share * 100:.0f}%</title></rect>')
            x += w
    legend_y = len(good) * row_h + 24
    lx = 10.0
    for cat in WAIT_CATEGORIES:
        parts.append(f'<rect x="{lx}" y="{legend_y - 9}" width="10" height="10" fill="{WAIT_COLOURS[cat]}"/>'
                     f'<text x="{lx + 13}" y="{legend_y}" font-size="10">{html.escape(cat)}</text>')
        lx += 24 + 6 * len(cat)  # room for the label at 10 px
    parts.append("</svg>")
    return "".join(parts)


def render_html(doc: Mapping[str, Any]) -> str:
    """A self-contained page: verdict, versions, the TPS and wait plots, the table."""
    rows = case_rows(doc)
    verdict = doc.get("verdict", {})
    word = verdict.get("word", "none")
    e = html.escape
    table = "".join(
        f"<tr><td>{e(r['case'])}</td><td>{r['guests']}</td><td>{r['vcpus']}</td>"
        + (f"<td colspan='7'>failed: {e(str(r['error']))}</td>" if r["error"] else
           f"<td>{r['tps'] or 0:,.0f}</td><td>{e(', '.join(f'{t:,.0f}' for t in r['runs']))}</td>"
           f"<td>{r['p50'] or 0:.2f}</td><td>{r['p99'] or 0:.2f}</td><td>{_split(r['guest_cpu'])}</td>"
           f"<td>{_split(r['host_cpu'])}</td><td>{e(r['top_wait'])}</td>")
        + "</tr>" for r in rows)
    caveat = f"<p class='caveat'>{e(verdict['caveat'])}</p>" if verdict.get("caveat") else ""
    left = ("yes" if doc.get("host_left_as_it_was") else "NO: " + "; ".join(doc.get("left_behind", []))) \
        if "host_left_as_it_was" in doc else "not checked"
    plan = doc.get("plan", {})
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>pgcarve advise: {e(str(plan.get('host')))}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1100px; }}
.verdict {{ font-size: 1.5em; font-weight: 600; color: {WORD_COLOURS.get(word, '#555')}; }}
.caveat {{ background: #fdf2d0; padding: .6em; border-left: 4px solid #9a7d0a; }}
table {{ border-collapse: collapse; font-size: .9em; }} td, th {{ border: 1px solid #ccc; padding: 4px 8px; }}
th {{ background: #f3f3f3; }} td:nth-child(n+2) {{ text-align: right; }}
.small {{ color: #555; font-size: .85em; }}
</style></head><body>
<h1>Does carving help on {e(str(plan.get('host')))}?</h1>
<p class="verdict" id="verdict">{e(verdict.get('headline', 'no verdict'))}</p>
<p id="reason">{e(verdict.get('reason', ''))}</p>
{caveat}
<p class="small">{e(verdict.get('figures', ''))}</p>
<p class="small">Measured: {e(versions_line(doc))}. Load: <code>{e(str(doc.get('load', {}).get('script', '')))}</code>
({e(str(doc.get('load', {}).get('clients', '')))} clients, {e(str(plan.get('seconds')))} s per run,
{e(str(plan.get('repeat')))} round(s)). Host left as it was: {e(left)}.
{e(str(doc.get('started_at', '')))} - {e(str(doc.get('finished_at', '')))}.</p>
<h2>Aggregate TPS per case (bar: median; dots: every run)</h2>
{_svg_tps(rows)}
<h2>What the client sessions waited on</h2>
{_svg_waits(rows)}
{f"<h2>The host's kernel during the single instance</h2><p class='small' id='profile'>{e(profile)}</p>"
   if (profile := profile_line(doc)) else ""}
<h2>Every case</h2>
<table><tr><th>case</th><th>guests</th><th>vCPUs</th><th>TPS (median)</th><th>runs</th><th>p50 ms</th>
<th>p99 ms</th><th>guest CPU user/sys/idle %</th><th>host CPU user/sys/idle %</th><th>top wait</th></tr>
{table}</table>
</body></html>
"""
