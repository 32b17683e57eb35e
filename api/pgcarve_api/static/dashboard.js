/* pgcarve live dashboard (vanilla JS, no build step).
 *
 * Data: /v1/tps/history once on load, then the SSE stream /v1/events (aggregate + per-instance
 * rates, instance count, running operations); /v1/instances every 2 s for placement and
 * replication; /v1/incidents every 2 s; /v1/operations/{id} for operations this page follows
 * until they finish.
 * Actions: scale (PUT /v1/scale) and a planned switchover per instance
 * (POST /v1/instances/{name}/switchover); both are followed in the operations panel.
 * Chart: uPlot (static/vendor/, built by build-vendor.sh), exposed as window.pgcarveChart.
 * The API token lives in sessionStorage only and is sent as a Bearer header, never in a URL.
 * Every API string is rendered with textContent, never as HTML.
 */
(() => {
  "use strict";

  const WINDOW_S = 300;            // chart span, seconds
  const INSTANCES_EVERY_MS = 2000;
  const HOSTS_EVERY_MS = 10000;
  const OPS_EVERY_MS = 1000;
  const INCIDENTS_EVERY_MS = 2000;
  const STALE_AFTER_MS = 5000;     // no event for this long: say so
  const MAX_OPS_SHOWN = 6;
  const TOKEN_KEY = "pgcarve.apiToken";
  const CHART_HEIGHT = 250;
  const SPARK_POINTS = 60;         // sparkline span: one point a second
  const SPARK_W = 96;              // sparkline size, CSS pixels
  const SPARK_H = 22;

  const $ = (id) => document.querySelector(`[data-testid="${id}"]`);

  // -- formatting for people -------------------------------------------------------------

  const SUFFIX = ["", "K", "M", "B", "T"];

  /** 12345 -> "12.3K", 1234567 -> "1.2M", 4.56 -> "4.6", null -> "—". */
  function human(n) {
    if (n === null || n === undefined || !Number.isFinite(n)) return "—";
    let v = Math.abs(n);
    let i = 0;
    while (i < SUFFIX.length - 1 && v >= 999.5) { v /= 1000; i += 1; }
    let s;
    if (i === 0) s = v < 9.95 && !Number.isInteger(v) ? v.toFixed(1) : String(Math.round(v));
    else s = v < 99.95 ? v.toFixed(1) : String(Math.round(v));
    return (n < 0 ? "-" : "") + s + SUFFIX[i];
  }

  const BYTE_UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];

  /** 1536 -> "1.5 KiB", 0 -> "0 B", null -> "—". */
  function humanBytes(n) {
    if (n === null || n === undefined || !Number.isFinite(n)) return "—";
    let v = Math.abs(n);
    let i = 0;
    while (i < BYTE_UNITS.length - 1 && v >= 1023.95) { v /= 1024; i += 1; }
    const s = i === 0 ? String(Math.round(v)) : (v < 99.95 ? v.toFixed(1) : String(Math.round(v)));
    return (n < 0 ? "-" : "") + s + " " + BYTE_UNITS[i];
  }

  /** [0,1,2,3,8] -> "0-3,8" */
  function cpuset(ids) {
    const sorted = [...new Set(ids || [])].sort((a, b) => a - b);
    const parts = [];
    for (let i = 0; i < sorted.length; i += 1) {
      let j = i;
      while (j + 1 < sorted.length && sorted[j + 1] === sorted[j] + 1) j += 1;
      parts.push(j > i ? `${sorted[i]}-${sorted[j]}` : String(sorted[i]));
      i = j;
    }
    return parts.join(",");
  }

  function clock(seconds) {
    return new Date(seconds * 1000).toLocaleTimeString([], { hour12: false });
  }

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined) continue;
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = value;
      else node.setAttribute(key, value);
    }
    for (const child of children) if (child !== null && child !== undefined) node.append(child);
    return node;
  }

  function badge(text, kind) {
    const cls = String(kind || text || "").toLowerCase().replace(/[^a-z0-9-]/g, "");
    return el("span", { class: `badge ${cls}`, text: text });
  }

  // -- API access --------------------------------------------------------------------------

  function getToken() {
    try { return sessionStorage.getItem(TOKEN_KEY); } catch { return null; }
  }
  function setToken(token) {
    try { sessionStorage.setItem(TOKEN_KEY, token); } catch { /* storage disabled: ask each time */ }
    syncTokenUi();
  }
  function clearToken() {
    try { sessionStorage.removeItem(TOKEN_KEY); } catch { /* nothing stored */ }
    syncTokenUi();
  }
  function syncTokenUi() {
    const button = $("token-button");
    const stored = Boolean(getToken());
    button.textContent = stored ? "forget token" : "set token";
    button.setAttribute("aria-label", stored ? "Forget the API token kept for this tab" : "Enter the API token");
  }

  /** fetch JSON; the stored token (if any) goes along, so reads also work off loopback. */
  async function api(path, { method = "GET", body, token } = {}) {
    const headers = { Accept: "application/json" };
    const bearer = token || getToken();
    if (bearer) headers.Authorization = `Bearer ${bearer}`;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const response = await fetch(path, {
      method, headers, cache: "no-store", credentials: "same-origin", redirect: "error",
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    let data = null;
    const text = await response.text();
    if (text) { try { data = JSON.parse(text); } catch { data = { detail: text.slice(0, 300) }; } }
    return { ok: response.ok, status: response.status, data };
  }

  /** The API's `detail`: a string, or FastAPI's list of validation errors. */
  function detailText(data, status) {
    const detail = data && data.detail;
    if (typeof detail === "string" && detail) return detail;
    if (Array.isArray(detail)) {
      return detail.map((e) => {
        const loc = (e.loc || []).filter((p) => p !== "body").join(".");
        return loc ? `${loc}: ${e.msg}` : String(e.msg);
      }).join("; ");
    }
    return `HTTP ${status}`;
  }

  // -- state -------------------------------------------------------------------------------

  const state = {
    instances: [],          // /v1/instances
    rates: {},              // name -> {tps, qps, replay_lag_bytes} from the latest tps document
    count: null,
    ops: new Map(),         // id -> operation (partial from SSE, full from /v1/operations)
    data: [[], [], []],     // uPlot columns: at, aggregate tps, aggregate qps
    lastEventMs: 0,
    polling: null,
    supervising: null,      // is the HA loop on (from /v1/hosts' watching_events)?
  };
  let chart = null;
  let opSeq = 0;
  // ms of the last table render, view update and sparkline pass, and of the last few of each
  // (timings.recent: tests take a median, which one descheduled pass cannot move)
  const timings = { recent: { renderMs: [], applyViewMs: [], sparklinesMs: [] } };
  function timed(name, started) {
    const ms = performance.now() - started;
    timings[name] = ms;
    const recent = timings.recent[name];
    recent.push(ms);
    if (recent.length > 10) recent.shift();
  }

  // -- connection status -------------------------------------------------------------------

  function setConn(kind, text) {
    const node = $("connection");
    node.classList.toggle("live", kind === "live");
    node.classList.toggle("down", kind === "down");
    node.querySelector(".conn-text").textContent = text;
  }

  // -- chart -------------------------------------------------------------------------------

  function yRange(_u, _min, max) {
    return [0, max > 0 ? max * 1.15 : 1];
  }

  // x-axis tick steps in seconds: never finer than a second (points come once a second).
  const TIME_INCRS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600];

  /** Legend: the value under the cursor, or the latest one when the cursor is elsewhere. */
  function legendValue(u, v, sidx, idx) {
    if (idx === null) {
      const col = u.data[sidx];
      return col.length ? human(col[col.length - 1]) : "—";
    }
    return human(v);
  }
  function latestTime(u) {
    const xs = u.data[0];
    return xs.length ? clock(xs[xs.length - 1]) : "—";
  }

  function makeChart() {
    const target = document.getElementById("chart");
    if (typeof window.uPlot !== "function") {
      target.append(el("p", {
        class: "error", "data-testid": "chart-missing",
        text: "Chart library missing: run api/pgcarve_api/static/build-vendor.sh on the server.",
      }));
      return;
    }
    const axisFont = "12px system-ui, sans-serif";
    const opts = {
      width: Math.max(300, target.clientWidth),
      height: CHART_HEIGHT,
      scales: {
        x: { time: true },
        tps: { auto: true, range: yRange },
        qps: { auto: true, range: yRange },
      },
      series: [
        { label: "Time", value: (u, ts, _s, idx) => (idx === null ? latestTime(u) : clock(ts)) },
        {
          label: "TPS", scale: "tps", stroke: "#2463eb", width: 2, fill: "rgba(36, 99, 235, 0.08)",
          points: { show: false }, value: legendValue,
        },
        {
          label: "QPS", scale: "qps", stroke: "#d9730d", width: 2,
          points: { show: false }, value: legendValue,
        },
      ],
      axes: [
        {
          font: axisFont, grid: { stroke: "#eef1f5" }, space: 70, incrs: TIME_INCRS,
          values: (_u, splits) => splits.map(clock),
        },
        {
          scale: "tps", label: "TPS", font: axisFont, labelFont: "bold 12px system-ui, sans-serif", size: 56,
          stroke: "#2463eb", grid: { stroke: "#eef1f5" }, values: (_u, splits) => splits.map(human),
        },
        {
          scale: "qps", label: "QPS", side: 1, font: axisFont, labelFont: "bold 12px system-ui, sans-serif",
          size: 56, stroke: "#d9730d", grid: { show: false }, values: (_u, splits) => splits.map(human),
        },
      ],
      cursor: { drag: { x: false, y: false } },
      legend: { live: true },
    };
    chart = new window.uPlot(opts, state.data, target);
    window.pgcarveChart = chart;
    if ("ResizeObserver" in window) {
      new ResizeObserver(() => {
        const width = Math.max(300, target.clientWidth);
        if (width !== chart.width) chart.setSize({ width, height: CHART_HEIGHT });
      }).observe(target);
    }
  }

  function trimWindow() {
    const [xs, tps, qps] = state.data;
    const newest = xs.length ? xs[xs.length - 1] : 0;
    let drop = 0;
    while (drop < xs.length && xs[drop] < newest - WINDOW_S) drop += 1;
    if (drop) { xs.splice(0, drop); tps.splice(0, drop); qps.splice(0, drop); }
  }

  function redraw() {
    if (chart) chart.setData(state.data);
    const xs = state.data[0];
    $("chart-updated").textContent = xs.length ? `updated ${clock(xs[xs.length - 1])}` : "waiting for data…";
  }

  /** Append one point per second (the stream may send more often). */
  function addPoint(doc) {
    const [xs, tps, qps] = state.data;
    const last = xs.length ? xs[xs.length - 1] : -Infinity;
    if (!(doc.at - last >= 0.9)) return;
    xs.push(doc.at);
    tps.push(doc.aggregate_tps);
    qps.push(doc.aggregate_qps);
    trimWindow();
    redraw();
  }

  // -- headline numbers --------------------------------------------------------------------

  function setHeadline(id, value, unit) {
    const node = $(id);
    node.textContent = "";
    if (!Number.isFinite(value)) return;  // nothing measured yet: leave it blank
    node.append(`${human(value)} `, el("span", { class: "unit", text: unit }));
    node.title = `${value.toFixed(1)} ${unit}`;
  }

  function setCount(n) {
    if (!Number.isInteger(n)) return;
    state.count = n;
    $("instance-count").textContent = String(n);
    const input = $("scale-input");
    if (input.value === "" && document.activeElement !== input) input.value = String(n);
  }

  // -- tps documents (history, stream, polling) ---------------------------------------------

  function onTps(doc) {
    if (!doc || typeof doc.at !== "number") return;
    state.lastEventMs = Date.now();
    state.rates = doc.instances || {};
    setHeadline("headline-tps", doc.aggregate_tps, "TPS");
    setHeadline("headline-qps", doc.aggregate_qps, "QPS");
    addPoint(doc);
    if (Number.isInteger(doc.instance_count)) setCount(doc.instance_count);
    if (Array.isArray(doc.operations)) mergeActiveOps(doc.operations);
    addSparkPoints(doc);
    renderRates();
  }

  async function loadHistory() {
    try {
      const r = await api(`/v1/tps/history?seconds=${WINDOW_S}`);
      if (!r.ok || !Array.isArray(r.data)) return;
      const [xs, tps, qps] = state.data;
      for (const doc of r.data) {
        if (xs.length && doc.at - xs[xs.length - 1] < 0.9) continue;
        xs.push(doc.at); tps.push(doc.aggregate_tps); qps.push(doc.aggregate_qps);
      }
      for (const doc of r.data.slice(-SPARK_POINTS)) addSparkPoints(doc);
      trimWindow();
      redraw();
      const latest = r.data[r.data.length - 1];
      if (latest) {
        state.rates = latest.instances || {};
        setHeadline("headline-tps", latest.aggregate_tps, "TPS");
        setHeadline("headline-qps", latest.aggregate_qps, "QPS");
      }
    } catch { /* the stream fills the chart anyway */ }
  }

  function connectEvents() {
    if (!("EventSource" in window)) { startPolling(); return; }
    const source = new EventSource("/v1/events");
    source.addEventListener("tps", (event) => {
      let doc;
      try { doc = JSON.parse(event.data); } catch { return; }
      onTps(doc);
      setConn("live", "live");
    });
    source.addEventListener("open", () => setConn("live", "live"));
    source.addEventListener("error", () => {
      if (source.readyState === EventSource.CLOSED) {
        // Refused for good (e.g. reads need the token off loopback): poll with fetch instead.
        setConn("down", "event stream refused; polling");
        startPolling();
      } else {
        setConn("down", "reconnecting…");
      }
    });
  }

  function startPolling() {
    if (state.polling) return;
    state.polling = setInterval(async () => {
      try {
        const r = await api("/v1/tps");
        if (r.ok) { onTps(r.data); setConn("live", "live (polling)"); }
        else setConn("down", r.status === 401 ? "reads need the API token" : `HTTP ${r.status}`);
        const ops = await api("/v1/operations");
        if (ops.ok && Array.isArray(ops.data)) {
          mergeActiveOps(ops.data.filter((op) => op.status === "pending" || op.status === "running"));
        }
      } catch { setConn("down", "server unreachable"); }
    }, 1000);
  }

  function watchStale() {
    setInterval(() => {
      if (!state.lastEventMs) return;
      const age = Date.now() - state.lastEventMs;
      if (age > STALE_AFTER_MS) setConn("down", `no data for ${Math.round(age / 1000)} s`);
    }, 1000);
  }

  // -- instances table ---------------------------------------------------------------------
  //
  // Built for hundreds of rows: each instance keeps its row and cells, which are updated in place
  // (text only when it changed); rows are re-ordered and filtered without being rebuilt, and the
  // TPS sparklines are small canvases redrawn once a second for the rows on show. The order is
  // applied when the instances are read again (every 2 s) or a header is clicked, not on every
  // rate update, so rows do not jump under the reader each second.

  const rows = new Map();   // name -> {tr, cells, canvas, button, stateKey, standbysKey, actionKey, filterText}
  const table = { sortKey: "name", sortDir: 1, filter: "", order: [] };
  const NUMERIC_SORTS = new Set(["tps", "qps", "lag", "cpus"]);

  async function loadInstances() {
    const error = $("instances-error");
    try {
      const r = await api("/v1/instances?include=retired");
      if (!r.ok) throw new Error(r.status === 401 ? "reads need the API token (use “set token”)"
        : detailText(r.data, r.status));
      state.instances = Array.isArray(r.data) ? r.data : [];
      error.hidden = true;
      const live = state.instances.filter((i) => i.state !== "retired").length;
      if (!Number.isInteger(state.count) || state.polling) setCount(live);
      renderInstances();
    } catch (err) {
      error.textContent = `Could not read the instances: ${err.message}`;
      error.hidden = false;
    }
  }

  // The guest's state, plus what an operator must know now: commits waiting, a fault being repaired.
  function stateCell(inst) {
    const wrap = el("span", { class: "state" });
    const b = badge(inst.state, inst.state === "running" ? "ok" : (inst.state === "retired" ? "retired" : "bad"));
    // Retired: its disks are kept; the words say since when, how much, and how to bring it back or purge it.
    if (inst.state === "retired" || inst.writes.startsWith("refused") || inst.writes.startsWith("not offered")) {
      b.title = inst.writes;
    }
    wrap.append(b);
    if (inst.writes && inst.writes.startsWith("refused")) {
      const f = badge("writes fenced", "pending");
      f.title = inst.writes;
      wrap.append(" ", f);
    }
    if (inst.writes && inst.writes.startsWith("waiting")) {
      const b = badge("writes waiting", "bad");
      b.title = inst.writes;
      wrap.append(" ", b);
    }
    if (inst.incident) {
      const b = badge("recovering", "pending");
      b.title = inst.incident;
      wrap.append(" ", b);
    }
    if (inst.patroni) wrap.append(" ", patroniBadge(inst.patroni));
    return wrap;
  }

  // Under Patroni: its timeline when all is well, else what is wrong; the title lists every member.
  function patroniBadge(p) {
    const b = badge(p.problem ? (p.leader ? "patroni: " + p.problem.split(":")[0] : "no leader")
      : `timeline ${p.timeline ?? "?"}`, p.problem ? "bad" : "ok");
    b.setAttribute("data-testid", "patroni");
    const members = p.members.map((m) => `${m.name}: ${m.role}, ${m.state}, timeline ${m.timeline ?? "?"}`
      + (m.lag_bytes ? `, ${humanBytes(m.lag_bytes)} behind` : ""));
    b.title = [p.problem || `Patroni: leader ${p.leader}, synchronous ${p.synchronous.join(", ") || "none"}`
      + ` (${p.synchronous_mode})`, ...members].join("\n");
    return b;
  }

  /** Problems first when sorted ascending: not running, writes waiting, being repaired, fine. */
  function stateRank(inst) {
    if (inst.state === "retired") return 4;
    if (inst.state !== "running") return 0;
    if (inst.writes && inst.writes.startsWith("waiting")) return 1;
    if (inst.incident || (inst.patroni && inst.patroni.problem)) return 2;
    return 3;
  }

  function standbyCell(standbys) {
    if (!standbys || !standbys.length) return el("span", { class: "muted", text: "none" });
    const wrap = el("div");
    for (const sb of standbys) {
      wrap.append(el("div", { class: "standby", "data-testid": "standby", "data-standby": sb.name },
        el("span", { class: "sb-name", text: sb.name }),
        badge(sb.state || "unknown", sb.state === "streaming" ? "streaming"
          : (sb.state === "retired" ? "retired" : (sb.state ? "pending" : "bad"))),
        sb.sync_state ? badge(sb.sync_state) : null,
        el("span", { class: "sb-lag", text: `lag ${humanBytes(sb.replay_lag_bytes)}` })));
    }
    return wrap;
  }

  function instanceLag(inst) {
    const rate = state.rates[inst.name];
    if (rate && Number.isFinite(rate.replay_lag_bytes)) return rate.replay_lag_bytes;
    const lags = (inst.standbys || []).map((s) => s.replay_lag_bytes).filter(Number.isFinite);
    return lags.length ? Math.max(...lags) : null;
  }

  function setText(node, text) {
    if (node.textContent !== text) node.textContent = text;
  }

  function makeRow(name) {
    const td = (testid, cls) => el("td", { "data-testid": testid, class: cls || null });
    const cells = {
      name: td("cell-name", "name"), host: td("cell-host"), state: td("cell-state"), cpus: td("cell-cpus"),
      memory: td("cell-memory"), tps: td("cell-tps", "num"), spark: td("cell-spark", "spark"),
      qps: td("cell-qps", "num"), standbys: td("cell-standbys"), lag: td("cell-lag", "num"),
      action: td("cell-action", "action"),
    };
    cells.name.append(el("span"));
    cells.cpus.append(el("code"));
    cells.qps.append(el("span"));
    const canvas = el("canvas", {
      "data-testid": "sparkline", width: String(SPARK_W), height: String(SPARK_H),
      role: "img", "aria-label": `${name}: transactions per second, last ${SPARK_POINTS} seconds`,
    });
    cells.spark.append(canvas);
    // No listener here: the table body's one click handler serves every row (onTableClick).
    const button = el("button", {
      type: "button", class: "row-action", "data-action": "switchover", "data-testid": "switchover-button",
      "aria-label": `Switch over ${name}`,
    }, "switch over");
    cells.action.append(button);
    const tr = el("tr", { "data-testid": "instance-row", "data-instance": name },
      cells.name, cells.host, cells.state, cells.cpus, cells.memory, cells.tps, cells.spark, cells.qps,
      cells.standbys, cells.lag, cells.action);
    return { tr, cells, canvas, button, standbysKey: null, stateKey: null, actionKey: null, filterText: "" };
  }

  /** Placement, state and standbys: from /v1/instances (every 2 s). */
  function updateRow(row, inst) {
    const c = row.cells;
    const cpus = inst.vcpus || [];
    setText(c.name.firstChild, inst.name);
    // The application's URI (follows failover); the admin DSN for an instance without endpoints yet.
    c.name.firstChild.title = (inst.endpoints && inst.endpoints.rw) || inst.dsn || "";
    setText(c.host, inst.host || "—");
    const stateKey = `${inst.state}|${inst.writes}|${inst.incident}|${JSON.stringify(inst.patroni || null)}`;
    if (row.stateKey !== stateKey) { row.stateKey = stateKey; c.state.replaceChildren(stateCell(inst)); }
    setText(c.cpus.firstChild, cpus.length ? cpuset(cpus) : "—");
    c.cpus.firstChild.title = `${cpus.length} vCPU(s)`;
    setText(c.memory, humanBytes((inst.memory_mib || 0) * 1048576));
    const standbysKey = JSON.stringify(inst.standbys || []);
    if (row.standbysKey !== standbysKey) { row.standbysKey = standbysKey; c.standbys.replaceChildren(standbyCell(inst.standbys)); }
    row.filterText = [inst.name, inst.host, inst.state, inst.writes, inst.incident, cpuset(cpus),
      inst.patroni && (inst.patroni.problem || inst.patroni.leader),
      ...(inst.standbys || []).flatMap((s) => [s.name, s.host, s.state, s.sync_state])]
      .filter(Boolean).join(" ").toLowerCase();
  }

  /** Rates and lag: from every tps document (once a second). */
  function updateRates(row, inst) {
    const rate = state.rates[inst.name] || null;
    setText(row.cells.tps, rate ? human(rate.tps) : "—");
    const qps = row.cells.qps.firstChild;
    setText(qps, rate ? (rate.qps === null ? "n/a" : human(rate.qps)) : "—");
    qps.title = rate && rate.qps === null ? "pg_stat_statements is not installed" : "";
    setText(row.cells.lag, humanBytes(instanceLag(inst)));
  }

  function sortValue(inst) {
    const rate = state.rates[inst.name];
    switch (table.sortKey) {
      case "host": return inst.host || "";
      case "state": return stateRank(inst);
      case "cpus": return inst.vcpus && inst.vcpus.length ? Math.min(...inst.vcpus) : null;
      case "tps": return rate ? rate.tps : null;
      case "qps": return rate && rate.qps !== null ? rate.qps : null;
      case "lag": return instanceLag(inst);
      default: return inst.name;
    }
  }

  const collator = new Intl.Collator(undefined, { numeric: true });

  function compareInstances(a, b) {
    const va = sortValue(a);
    const vb = sortValue(b);
    // Unknown values last, whichever the direction.
    if (va === null || vb === null) return va === vb ? collator.compare(a.name, b.name) : (va === null ? 1 : -1);
    const c = typeof va === "number" ? va - vb : collator.compare(va, vb);
    return c !== 0 ? c * table.sortDir : collator.compare(a.name, b.name);
  }

  /** Order and filter the rows (no row is rebuilt); "N of M" under the filter. */
  function applyView() {
    const started = performance.now();
    const body = $("instances-body");
    const sorted = [...state.instances].sort(compareInstances);
    const words = table.filter.toLowerCase().split(/\s+/).filter(Boolean);
    let shown = 0;
    for (const inst of sorted) {
      const row = rows.get(inst.name);
      const match = words.every((w) => row.filterText.includes(w));
      if (row.tr.hidden === match) row.tr.hidden = !match;
      if (match) shown += 1;
    }
    const order = sorted.map((inst) => inst.name);
    if (order.length !== table.order.length || order.some((name, i) => name !== table.order[i])) {
      body.append(...order.map((name) => rows.get(name).tr));  // moves rows; nothing is re-created
      table.order = order;
    }
    const total = state.instances.length;
    $("instance-filter-count").textContent = words.length ? `${shown} of ${total} shown` : `${total} instances`;
    $("instances-empty").hidden = total > 0;
    $("instances-nomatch").hidden = !(total > 0 && shown === 0);
    for (const th of document.querySelectorAll("th[data-sort]")) {
      const active = th.dataset.sort === table.sortKey;
      th.setAttribute("aria-sort", active ? (table.sortDir > 0 ? "ascending" : "descending") : "none");
    }
    timed("applyViewMs", started);
  }

  function renderInstances() {
    const started = performance.now();
    const seen = new Set();
    const busy = busyInstances();
    for (const inst of state.instances) {
      seen.add(inst.name);
      let row = rows.get(inst.name);
      if (!row) { row = makeRow(inst.name); rows.set(inst.name, row); }
      updateRow(row, inst);
      updateRates(row, inst);
      updateAction(row, inst, busy);
    }
    for (const [name, row] of rows) {
      if (!seen.has(name)) { row.tr.remove(); rows.delete(name); sparks.delete(name); }
    }
    applyView();
    drawSparklines();
    timed("renderMs", started);
  }

  function renderRates() {
    for (const inst of state.instances) {
      const row = rows.get(inst.name);
      if (row) updateRates(row, inst);
    }
    drawSparklines();
  }

  function onSortClick(event) {
    const th = event.target.closest("th[data-sort]");
    if (!th) return;
    const key = th.dataset.sort;
    // First click: numbers largest first, words A to Z; next clicks reverse.
    if (table.sortKey === key) table.sortDir = -table.sortDir;
    else { table.sortKey = key; table.sortDir = NUMERIC_SORTS.has(key) ? -1 : 1; }
    applyView();
  }

  // -- switchover, per instance ------------------------------------------------------------
  //
  // A button per row, served by one click handler on the table body. A button that cannot act is
  // aria-disabled rather than disabled, so it stays focusable and its title (the reason) can be
  // reached from the keyboard; clicking it only repeats the reason. The request goes out with the
  // token the scale control keeps, and the operation is followed like a scale's (refreshOp).

  // The states a standby's `state` carries when its guest is not running (libvirt's, as
  // manager/pgcarve/virt/host.py names them); any other state is a running guest.
  const GUEST_DOWN = new Set(["paused", "shutting-down", "shut-off", "crashed", "suspended", "unknown"]);
  const requesting = new Set();  // instances whose switchover request has not been answered yet

  const runningStandbys = (inst) => (inst.standbys || []).filter((sb) => sb.state && !GUEST_DOWN.has(sb.state));

  /** Instances an operation is working on now (or a request of this page is on its way for). */
  function busyInstances() {
    const busy = new Set(requesting);
    for (const op of state.ops.values()) if (isActive(op) && op.params && op.params.instance) busy.add(op.params.instance);
    return busy;
  }

  /** Why `inst` cannot be switched over now, or null when it can. */
  function switchoverBlocked(inst, busy) {
    if (inst.state === "retired") return `${inst.name} is retired (its disks are kept): scale up to bring it back`;
    if (inst.state !== "running") {
      return `${inst.name}'s primary is not running (${inst.state}): there is nothing to switch over from`;
    }
    if (!runningStandbys(inst).length) return `${inst.name} has no running standby to switch over to`;
    if (busy.has(inst.name)) return `an operation on ${inst.name} is under way`;
    return null;
  }

  function updateAction(row, inst, busy) {
    const reason = switchoverBlocked(inst, busy);
    const key = reason || "";
    if (row.actionKey === key) return;  // touch the DOM only when it changes
    row.actionKey = key;
    row.button.setAttribute("aria-disabled", reason ? "true" : "false");
    row.button.title = reason
      || `Hand ${inst.name}'s primary role to a standby: writes pause for a few seconds, nothing is lost`;
  }

  /** Between two reads of the instances: an operation started or ended. */
  function refreshActions() {
    const busy = busyInstances();
    for (const inst of state.instances) {
      const row = rows.get(inst.name);
      if (row) updateAction(row, inst, busy);
    }
  }

  function showSwitchoverMessage(kind, text) {
    const node = $("switchover-message");
    node.className = `action-msg ${kind}`;
    node.textContent = text;
  }

  function standbyLabel(sb) {
    const how = [sb.sync_state, sb.state].filter(Boolean).join(", ");
    return `${sb.name} on ${sb.host}${how ? ` (${how})` : ""}`;
  }

  /** Confirm in plain words, with a choice of standby; resolves to {to} (null: the synchronous
   * standby, as the API decides) or null when cancelled. */
  function confirmSwitchover(inst) {
    const dialog = $("switchover-dialog");
    const select = $("switchover-target");
    const standbys = runningStandbys(inst);
    select.replaceChildren(el("option", { value: "", text: "the synchronous standby" }),
      ...standbys.map((sb) => el("option", { value: sb.name, text: standbyLabel(sb) })));
    const ask = () => {
      const chosen = standbys.find((sb) => sb.name === select.value);
      $("switchover-question").textContent = chosen
        ? `Switch ${inst.name}'s primary to ${chosen.name} on ${chosen.host}? Writes pause for a few seconds; nothing is lost.`
        : `Switch ${inst.name}'s primary to its synchronous standby? Writes pause for a few seconds; nothing is lost.`;
    };
    select.onchange = ask;  // a property, not a listener: each dialog replaces the last one's
    ask();
    $("switchover-title").textContent = `Switch over ${inst.name}`;
    return new Promise((resolve) => {
      dialog.returnValue = "";
      dialog.addEventListener("close", () => {
        resolve(dialog.returnValue === "ok" ? { to: select.value || null } : null);
      }, { once: true });
      dialog.showModal();
    });
  }

  async function switchOver(inst) {
    const choice = await confirmSwitchover(inst);
    if (!choice) return;
    let token = getToken();
    if (!token) {
      token = await askToken();
      if (!token) { showSwitchoverMessage("", `${inst.name} not switched over: no API token given.`); return; }
      setToken(token);
    }
    const where = choice.to || "its synchronous standby";
    requesting.add(inst.name);
    refreshActions();
    showSwitchoverMessage("", `Asking to switch ${inst.name} over to ${where}…`);
    try {
      const r = await api(`/v1/instances/${encodeURIComponent(inst.name)}/switchover`, {
        method: "POST", body: choice.to ? { to: choice.to } : {}, token,
      });
      if (r.status === 202 && r.data) {
        const op = upsertOp({
          id: r.data.operation, kind: "switchover", status: r.data.status, progress: 0, message: "accepted",
          created_at: Date.now() / 1000, params: { instance: inst.name, to: choice.to },
        });
        opEndHandlers.set(op.id, (done) => {
          if (done.status === "succeeded") showSwitchoverMessage("info", `${inst.name}: ${opOutcome(done)}`);
          else showSwitchoverMessage("error", `${inst.name} not switched over: ${done.error || done.message}`);
        });
        renderOps();
        refreshOp(op.id);
        showSwitchoverMessage("info", `Accepted: switching ${inst.name} over to ${where} (operation ${op.id}).`);
      } else if (r.status === 401) {
        clearToken();
        showSwitchoverMessage("error", "Wrong token: the API refused it (401). Press “switch over” to enter it again.");
      } else {
        showSwitchoverMessage("error", `${inst.name} not switched over: ${detailText(r.data, r.status)}`);
      }
    } catch (err) {
      showSwitchoverMessage("error", `Could not reach the API: ${err.message}`);
    } finally {
      requesting.delete(inst.name);
      refreshActions();
    }
  }

  /** The table body's one click handler for every row's button. */
  function onTableClick(event) {
    const button = event.target.closest('button[data-action="switchover"]');
    if (!button) return;
    const name = button.closest("tr").dataset.instance;
    const inst = state.instances.find((i) => i.name === name);
    if (!inst) return;
    const reason = switchoverBlocked(inst, busyInstances());
    if (reason) { showSwitchoverMessage("error", `Not switched over: ${reason}.`); return; }
    switchOver(inst);
  }

  // -- sparklines --------------------------------------------------------------------------

  const sparks = new Map();  // name -> TPS values, oldest first, at most SPARK_POINTS
  let lastSparkAt = -Infinity;

  /** One point per instance per second, from a tps document (history or stream). */
  function addSparkPoints(doc) {
    if (!(doc.at - lastSparkAt >= 0.9)) return;
    lastSparkAt = doc.at;
    for (const [name, rate] of Object.entries(doc.instances || {})) {
      let values = sparks.get(name);
      if (!values) { values = []; sparks.set(name, values); }
      values.push(Number.isFinite(rate.tps) ? rate.tps : 0);
      if (values.length > SPARK_POINTS) values.splice(0, values.length - SPARK_POINTS);
    }
  }

  function drawSparklines() {
    const started = performance.now();
    const ratio = window.devicePixelRatio || 1;
    for (const [name, row] of rows) {
      if (row.tr.hidden) continue;
      const values = sparks.get(name) || [];
      const canvas = row.canvas;
      if (canvas.width !== Math.round(SPARK_W * ratio)) {
        canvas.width = Math.round(SPARK_W * ratio);
        canvas.height = Math.round(SPARK_H * ratio);
      }
      const ctx = canvas.getContext("2d");
      ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
      ctx.clearRect(0, 0, SPARK_W, SPARK_H);
      canvas.dataset.points = String(values.length);
      if (values.length < 2) continue;
      const max = Math.max(...values) || 1;
      const step = (SPARK_W - 2) / (SPARK_POINTS - 1);
      const x0 = SPARK_W - 1 - step * (values.length - 1);
      ctx.beginPath();
      values.forEach((v, i) => {
        const x = x0 + step * i;
        const y = SPARK_H - 2 - (v / max) * (SPARK_H - 4);
        if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
      });
      ctx.strokeStyle = "#2463eb";
      ctx.lineWidth = 1.25;
      ctx.stroke();
      ctx.lineTo(x0 + step * (values.length - 1), SPARK_H);
      ctx.lineTo(x0, SPARK_H);
      ctx.closePath();
      ctx.fillStyle = "rgba(36, 99, 235, 0.12)";
      ctx.fill();
    }
    timed("sparklinesMs", started);
  }

  // -- incidents ---------------------------------------------------------------------------

  const MAX_RECENT_INCIDENTS = 8;
  const OPEN_INCIDENT = new Set(["recovering", "failed"]);

  /** 75 -> "1 min 15 s", 3.2 -> "3.2 s" */
  function duration(seconds) {
    if (!Number.isFinite(seconds) || seconds < 0) return "—";
    if (seconds < 10) return `${seconds.toFixed(1)} s`;
    if (seconds < 60) return `${Math.round(seconds)} s`;
    const minutes = Math.floor(seconds / 60);
    if (minutes < 60) return `${minutes} min ${Math.round(seconds - minutes * 60)} s`;
    return `${Math.floor(minutes / 60)} h ${minutes % 60} min`;
  }

  async function loadIncidents() {
    try {
      const r = await api("/v1/incidents");
      if (!r.ok || !Array.isArray(r.data)) return;
      renderIncidents(r.data);
    } catch { /* shown again on the next round */ }
  }

  function renderIncidents(all) {
    const open = all.filter((i) => OPEN_INCIDENT.has(i.status)).sort((a, b) => b.detected_at - a.detected_at);
    const recent = all.filter((i) => !OPEN_INCIDENT.has(i.status))
      .sort((a, b) => (b.finished_at || b.detected_at) - (a.finished_at || a.detected_at))
      .slice(0, MAX_RECENT_INCIDENTS);
    const now = Date.now() / 1000;
    const item = (inc) => {
      const where = inc.guest && inc.guest !== inc.instance ? `${inc.instance} · ${inc.guest}` : inc.instance;
      const how = inc.source === "event" ? "libvirt event" : "periodic check";
      // A failed repair stays open (it is tried again): its age, not its last attempt, matters.
      const took = OPEN_INCIDENT.has(inc.status) || !inc.finished_at ? `open for ${duration(now - inc.detected_at)}`
        : `took ${duration(inc.finished_at - inc.detected_at)}`;
      const action = inc.action && inc.action !== "none" ? inc.action
        : (inc.status === "recovering" ? "repairing" : "nothing");
      return el("li", {
        class: `incident ${inc.status}`, "data-testid": "incident", "data-incident-id": String(inc.id),
        "data-status": inc.status, "data-instance": inc.instance,
      },
      el("div", { class: "inc-head" },
        el("span", { class: "inc-title", "data-testid": "incident-what", text: `${where}: ${inc.what}` }),
        badge(inc.status, inc.status === "recovered" ? "ok" : (inc.status === "recovering" ? "pending" : "bad"))),
      el("p", { class: "inc-line", "data-testid": "incident-when",
        text: `${clock(inc.detected_at)} (${how}, on ${inc.host}) · ${inc.cause}` }),
      el("p", { class: "inc-line", "data-testid": "incident-action",
        text: `action: ${action}${inc.attempts > 1 ? ` (${inc.attempts} attempts)` : ""} · ${took}` }),
      inc.message ? el("p", { class: "inc-msg", "data-testid": "incident-message", text: inc.message }) : null);
    };
    $("incidents-open").replaceChildren(...open.map(item));
    $("incidents-recent").replaceChildren(...recent.map(item));
    $("incidents-open-head").hidden = open.length === 0;
    $("incidents-recent-head").hidden = recent.length === 0;
    $("incidents-summary").textContent = open.length ? `${open.length} open` : "none open";
    $("incidents-summary").className = open.length ? "badge bad" : "badge ok";
    const empty = $("incidents-empty");
    empty.hidden = all.length > 0;
    empty.textContent = state.supervising === false
      ? "The HA loop is off (PGCARVE_SUPERVISE=0): faults are neither noticed nor repaired."
      : "No incident: no guest has stopped or paused on its own since the manager started.";
  }

  async function loadHosts() {
    try {
      const r = await api("/v1/hosts");
      if (!r.ok || !Array.isArray(r.data)) return;
      state.supervising = r.data.some((h) => h.watching_events !== null && h.watching_events !== undefined);
      $("hosts").textContent = r.data.map((h) => `${h.name} (${h.role}): ${h.free_cpus}/${h.cpus} CPUs free`).join(" · ");
    } catch { /* shown again on the next round */ }
  }

  // -- operations --------------------------------------------------------------------------

  function upsertOp(doc) {
    const known = state.ops.get(doc.id);
    const merged = Object.assign(known || { seq: (opSeq += 1) }, doc);
    state.ops.set(doc.id, merged);
    return merged;
  }

  const isActive = (op) => op.status === "pending" || op.status === "running";

  /** What an operation does, in the words of the control that started it. */
  function opTitle(op) {
    const instance = op.params && op.params.instance;
    if (op.kind === "scale") return `Scale to ${op.target}`;
    if (op.kind === "switchover") return `Switch over ${instance || "an instance"}`;
    if (op.kind) return instance ? `${op.kind}: ${instance}` : op.kind;
    return "Operation";  // seen on the stream only, until its document is read
  }

  /** Its message; a switchover that ended says where the primary went and how long writes paused. */
  function opOutcome(op) {
    const r = op.result || {};
    if (op.kind === "switchover" && op.status === "succeeded" && r.new_primary && r.host
        && Number.isFinite(r.write_pause_s)) {
      return `switched over to ${r.new_primary} on ${r.host}; writes paused ${r.write_pause_s.toFixed(1)} s`;
    }
    return op.message || "";
  }

  /** The control that started an operation is told once, when it ends. */
  const opEndHandlers = new Map();  // id -> (op) => void
  function onOpFinished(op) {
    const handler = opEndHandlers.get(op.id);
    if (handler) { opEndHandlers.delete(op.id); handler(op); }
  }

  /** The stream lists running operations; one that drops out has finished: fetch its result. The
   * stream leaves out what kind each is, so one seen there first is read in full once. */
  function mergeActiveOps(active) {
    const ids = new Set();
    for (const op of active) {
      ids.add(op.id);
      if (!upsertOp(op).kind) refreshOp(op.id);
    }
    for (const op of state.ops.values()) if (isActive(op) && !ids.has(op.id)) refreshOp(op.id);
    renderOps();
  }

  async function refreshOp(id) {
    try {
      const r = await api(`/v1/operations/${encodeURIComponent(id)}`);
      if (!r.ok || !r.data) return;
      const known = state.ops.get(id);
      const wasActive = !known || isActive(known);
      const op = upsertOp(r.data);
      renderOps();
      // An operation that ended changed the fleet (new instances, a new primary): show it now.
      if (wasActive && !isActive(op)) { onOpFinished(op); loadInstances(); }
    } catch { /* next round */ }
  }

  async function loadOperations() {
    try {
      const r = await api("/v1/operations");
      if (!r.ok || !Array.isArray(r.data)) return;
      for (const op of r.data.slice(-MAX_OPS_SHOWN)) upsertOp(op);
      renderOps();
    } catch { /* next round */ }
  }

  function followActiveOps() {
    setInterval(() => {
      for (const op of state.ops.values()) if (isActive(op)) refreshOp(op.id);
    }, OPS_EVERY_MS);
  }

  function renderOps() {
    const list = $("operations");
    const ops = [...state.ops.values()]
      .sort((a, b) => (b.created_at || 0) - (a.created_at || 0) || b.seq - a.seq)
      .slice(0, MAX_OPS_SHOWN);
    list.replaceChildren(...ops.map((op) => {
      const pct = Math.round(Math.max(0, Math.min(1, op.status === "succeeded" ? 1 : op.progress || 0)) * 100);
      const when = op.created_at ? ` · ${clock(op.created_at)}` : "";
      const title = opTitle(op);
      return el("li", {
        class: `op ${op.status}`, "data-testid": "operation", "data-op-id": op.id, "data-status": op.status,
        "data-kind": op.kind || null,
      },
        el("div", { class: "op-head" },
          el("span", { class: "op-title", "data-testid": "operation-title", text: title }),
          el("span", {}, badge(op.status), el("span", { class: "muted", text: ` ${pct}%` }))),
        el("div", {
          class: "bar", role: "progressbar", "aria-label": `${title}: progress`,
          "aria-valuemin": "0", "aria-valuemax": "100", "aria-valuenow": String(pct), "data-testid": "operation-progress",
        }, el("span")),
        el("p", { class: "op-msg", "data-testid": "operation-message", text: `${opOutcome(op)}${when} · ${op.id}` }),
        op.error ? el("p", { class: "op-error", "data-testid": "operation-error", text: op.error }) : null);
    }));
    // Bar widths through CSSOM (allowed by the page's CSP, unlike style attributes).
    for (const li of list.children) {
      const bar = li.querySelector(".bar");
      bar.firstChild.style.width = `${bar.getAttribute("aria-valuenow")}%`;
    }
    $("operations-empty").hidden = ops.length > 0;
  }

  // -- scale control -----------------------------------------------------------------------

  function showScaleMessage(kind, text) {
    const node = $("scale-message");
    node.className = `scale-msg ${kind}`;
    node.textContent = text;
  }

  /** Ask for the token in a modal password field; resolves to the token or null. */
  function askToken() {
    const dialog = $("token-dialog");
    const input = $("token-input");
    return new Promise((resolve) => {
      input.value = "";
      dialog.returnValue = "";
      dialog.addEventListener("close", () => {
        const token = dialog.returnValue === "ok" ? input.value.trim() : "";
        input.value = "";
        resolve(token || null);
      }, { once: true });
      dialog.showModal();
      input.focus();
    });
  }

  async function onScale(event) {
    event.preventDefault();
    const input = $("scale-input");
    const button = $("scale-button");
    const raw = input.value.trim();
    if (!/^\d+$/.test(raw) || Number(raw) > 100000) {
      showScaleMessage("error", "Enter a whole number of instances, from 0 to 100000.");
      input.focus();
      return;
    }
    const wanted = Number(raw);
    let token = getToken();
    if (!token) {
      token = await askToken();
      if (!token) { showScaleMessage("", "Not scaled: no API token given."); return; }
      setToken(token);
    }
    button.disabled = true;
    showScaleMessage("", `Asking for ${wanted} instance(s)…`);
    try {
      const r = await api("/v1/scale", { method: "PUT", body: { instances: wanted }, token });
      if (r.status === 202 && r.data) {
        const op = upsertOp({
          id: r.data.operation, kind: "scale", status: r.data.status, target: r.data.target, progress: 0,
          message: "accepted", created_at: Date.now() / 1000,
        });
        renderOps();
        refreshOp(op.id);
        showScaleMessage("info", `Accepted: scaling to ${r.data.target} (operation ${r.data.operation}).`);
      } else if (r.status === 401) {
        clearToken();
        showScaleMessage("error", "Wrong token: the API refused it (401). Press Scale to enter it again.");
      } else if (r.status === 409) {
        showScaleMessage("error", `Cannot scale to ${wanted}: ${detailText(r.data, r.status)}`);
      } else if (r.status === 422) {
        showScaleMessage("error", `Invalid request: ${detailText(r.data, r.status)}`);
      } else {
        showScaleMessage("error", `Scale failed (HTTP ${r.status}): ${detailText(r.data, r.status)}`);
      }
    } catch (err) {
      showScaleMessage("error", `Could not reach the API: ${err.message}`);
    } finally {
      button.disabled = false;
    }
  }

  // -- start -------------------------------------------------------------------------------

  async function start() {
    syncTokenUi();
    $("scale-form").addEventListener("submit", onScale);
    $("token-button").addEventListener("click", async () => {
      if (getToken()) {
        clearToken();
        showScaleMessage("", "Token forgotten for this tab.");
        return;
      }
      const token = await askToken();
      if (token) {
        setToken(token);
        showScaleMessage("", "Token kept for this tab (session storage).");
        loadInstances();
        loadHosts();
      }
    });
    $("instances-table").querySelector("thead").addEventListener("click", onSortClick);
    $("instances-body").addEventListener("click", onTableClick);
    $("instance-filter").addEventListener("input", (event) => {
      table.filter = event.target.value;
      applyView();
      drawSparklines();
    });
    makeChart();
    redraw();
    loadInstances();
    loadHosts();
    loadOperations();
    loadIncidents();
    setInterval(loadInstances, INSTANCES_EVERY_MS);
    setInterval(loadIncidents, INCIDENTS_EVERY_MS);
    setInterval(loadHosts, HOSTS_EVERY_MS);
    followActiveOps();
    watchStale();
    await loadHistory();
    connectEvents();
  }

  window.pgcarveDashboard = { human, humanBytes, cpuset, duration, state, sparks, timings };
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
