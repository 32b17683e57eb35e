/* pgcarve live dashboard (vanilla JS, no build step).
 *
 * Data: /v1/tps/history once on load, then the SSE stream /v1/events (aggregate + per-instance
 * rates, instance count, running operations); /v1/instances every 2 s for placement and
 * replication; /v1/operations/{id} for operations this page follows until they finish.
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
  const STALE_AFTER_MS = 5000;     // no event for this long: say so
  const MAX_OPS_SHOWN = 6;
  const TOKEN_KEY = "pgcarve.apiToken";
  const CHART_HEIGHT = 250;

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
  };
  let chart = null;
  let opSeq = 0;

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
    renderInstances();
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

  async function loadInstances() {
    const error = $("instances-error");
    try {
      const r = await api("/v1/instances");
      if (!r.ok) throw new Error(r.status === 401 ? "reads need the API token (use “set token”)"
        : detailText(r.data, r.status));
      state.instances = Array.isArray(r.data) ? r.data : [];
      error.hidden = true;
      if (!Number.isInteger(state.count) || state.polling) setCount(state.instances.length);
      renderInstances();
    } catch (err) {
      error.textContent = `Could not read the instances: ${err.message}`;
      error.hidden = false;
    }
  }

  // The guest's state, plus what an operator must know now: commits waiting, a fault being repaired.
  function stateCell(inst) {
    const wrap = el("span", { class: "state" });
    wrap.append(badge(inst.state, inst.state === "running" ? "ok" : "bad"));
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
    return wrap;
  }

  function standbyCell(standbys) {
    if (!standbys || !standbys.length) return el("span", { class: "muted", text: "none" });
    const wrap = el("div");
    for (const sb of standbys) {
      wrap.append(el("div", { class: "standby", "data-testid": "standby", "data-standby": sb.name },
        el("span", { class: "sb-name", text: sb.name }),
        badge(sb.state || "unknown", sb.state === "streaming" ? "streaming" : (sb.state ? "pending" : "bad")),
        sb.sync_state ? badge(sb.sync_state) : null,
        el("span", { class: "sb-lag", text: `lag ${humanBytes(sb.replay_lag_bytes)}` })));
    }
    return wrap;
  }

  function cell(testid, cls, ...content) {
    return el("td", { "data-testid": testid, class: cls }, ...content);
  }

  function renderInstances() {
    const body = $("instances-body");
    const rows = new Map([...body.children].map((tr) => [tr.dataset.instance, tr]));
    const seen = new Set();
    for (const inst of state.instances) {
      seen.add(inst.name);
      const rate = state.rates[inst.name] || null;
      const lags = (inst.standbys || []).map((s) => s.replay_lag_bytes).filter(Number.isFinite);
      const lag = rate && Number.isFinite(rate.replay_lag_bytes) ? rate.replay_lag_bytes
        : (lags.length ? Math.max(...lags) : null);
      const qpsText = rate ? (rate.qps === null ? "n/a" : human(rate.qps)) : "—";
      const cpus = inst.vcpus || [];
      const cells = [
        cell("cell-name", "name", el("span", { text: inst.name, title: inst.dsn || "" })),
        cell("cell-host", "", inst.host || "—"),
        cell("cell-state", "", stateCell(inst)),
        cell("cell-cpus", "", el("code", { text: cpus.length ? cpuset(cpus) : "—", title: `${cpus.length} vCPU(s)` })),
        cell("cell-memory", "", humanBytes((inst.memory_mib || 0) * 1048576)),
        cell("cell-tps", "num", rate ? human(rate.tps) : "—"),
        cell("cell-qps", "num", el("span", {
          text: qpsText, title: rate && rate.qps === null ? "pg_stat_statements is not installed" : null,
        })),
        cell("cell-standbys", "", standbyCell(inst.standbys)),
        cell("cell-lag", "num", humanBytes(lag)),
      ];
      let tr = rows.get(inst.name);
      if (!tr) {
        tr = el("tr", { "data-testid": "instance-row", "data-instance": inst.name });
        body.append(tr);
      }
      tr.replaceChildren(...cells);
    }
    for (const [name, tr] of rows) if (!seen.has(name)) tr.remove();
    // Keep the API's order (by instance number).
    for (const inst of state.instances) {
      const tr = body.querySelector(`tr[data-instance="${CSS.escape(inst.name)}"]`);
      if (tr) body.append(tr);
    }
    $("instances-empty").hidden = state.instances.length > 0;
  }

  async function loadHosts() {
    try {
      const r = await api("/v1/hosts");
      if (!r.ok || !Array.isArray(r.data)) return;
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

  /** The stream lists running operations; one that drops out has finished: fetch its result. */
  function mergeActiveOps(active) {
    const ids = new Set();
    for (const op of active) { ids.add(op.id); upsertOp(op); }
    for (const op of state.ops.values()) if (isActive(op) && !ids.has(op.id)) refreshOp(op.id);
    renderOps();
  }

  async function refreshOp(id) {
    try {
      const r = await api(`/v1/operations/${encodeURIComponent(id)}`);
      if (r.ok && r.data) { upsertOp(r.data); renderOps(); }
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
      return el("li", { class: `op ${op.status}`, "data-testid": "operation", "data-op-id": op.id, "data-status": op.status },
        el("div", { class: "op-head" },
          el("span", { class: "op-title", text: `Scale to ${op.target}` }),
          el("span", {}, badge(op.status), el("span", { class: "muted", text: ` ${pct}%` }))),
        el("div", {
          class: "bar", role: "progressbar", "aria-label": `Scale to ${op.target}: progress`,
          "aria-valuemin": "0", "aria-valuemax": "100", "aria-valuenow": String(pct), "data-testid": "operation-progress",
        }, el("span")),
        el("p", { class: "op-msg", "data-testid": "operation-message", text: `${op.message || ""}${when} · ${op.id}` }),
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
          id: r.data.operation, status: r.data.status, target: r.data.target, progress: 0,
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
    makeChart();
    redraw();
    loadInstances();
    loadHosts();
    loadOperations();
    setInterval(loadInstances, INSTANCES_EVERY_MS);
    setInterval(loadHosts, HOSTS_EVERY_MS);
    followActiveOps();
    watchStale();
    await loadHistory();
    connectEvents();
  }

  window.pgcarveDashboard = { human, humanBytes, cpuset, state };
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
