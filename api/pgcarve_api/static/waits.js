/* pgcarve dashboard: "what commits wait on" (GET /v1/instances/{name}/waits every 2 s).
 *
 * One stacked bar per selected instance: each category's share of the client sessions seen in the
 * sampler's window (SyncRep is a commit waiting for its synchronous standby). The instance list
 * comes from /v1/instances. Strings from the API are rendered with textContent only.
 */
(() => {
  "use strict";

  const EVERY_MS = 2000;
  const TOKEN_KEY = "pgcarve.apiToken";  // the same session-only token as dashboard.js
  const $ = (id) => document.querySelector(`[data-testid="${id}"]`);

  async function getJson(path) {
    const headers = { Accept: "application/json" };
    let token = null;
    try { token = sessionStorage.getItem(TOKEN_KEY); } catch { /* storage disabled */ }
    if (token) headers.Authorization = `Bearer ${token}`;
    const response = await fetch(path, { headers, cache: "no-store", credentials: "same-origin", redirect: "error" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    return response.json();
  }

  /** "WAL write" -> "w-WAL-write": the category's colour class. */
  const colourClass = (category) => `w-${category.replace(/[^A-Za-z0-9]+/g, "-")}`;

  function syncOptions(names) {
    const select = $("waits-instance");
    const current = [...select.options].map((o) => o.value);
    if (current.join("\n") === names.join("\n")) return;
    const keep = select.value;
    select.replaceChildren(...names.map((name) => {
      const option = document.createElement("option");
      option.value = name;
      option.textContent = name;
      return option;
    }));
    if (names.includes(keep)) select.value = keep;
  }

  function render(doc) {
    const bar = $("waits-bar");
    const legend = $("waits-legend");
    const seen = Object.entries(doc.shares).filter(([, share]) => share > 0);
    bar.replaceChildren(...seen.map(([category, share]) => {
      const part = document.createElement("span");
      part.className = colourClass(category);
      part.style.width = `${(share * 100).toFixed(2)}%`;
      part.title = `${category}: ${(share * 100).toFixed(1)}% — ${doc.meaning[category] || ""}`;
      return part;
    }));
    legend.replaceChildren(...seen.sort((a, b) => b[1] - a[1]).map(([category, share]) => {
      const item = document.createElement("li");
      item.dataset.category = category;
      const swatch = document.createElement("span");
      swatch.className = `swatch ${colourClass(category)}`;
      const label = document.createElement("span");
      label.textContent = `${category} ${(share * 100).toFixed(0)}%`;
      label.title = doc.meaning[category] || "";
      item.append(swatch, label);
      return item;
    }));
    $("waits-summary").textContent = doc.summary;
  }

  // tick runs on every change of instance and on a timer, so answers can arrive out of order: one
  // for an instance no longer selected must not be drawn over the selected one's.
  const stillSelected = (name) => name === $("waits-instance").value;

  async function tick() {
    let name = null;
    try {
      const instances = await getJson("/v1/instances");
      syncOptions(instances.map((inst) => inst.name));
      name = $("waits-instance").value;
      if (!name) {
        $("waits-bar").replaceChildren();
        $("waits-legend").replaceChildren();
        $("waits-summary").textContent = "No instance yet.";
        return;
      }
      const doc = await getJson(`/v1/instances/${encodeURIComponent(name)}/waits`);
      if (stillSelected(doc.instance)) render(doc);
    } catch (err) {
      if (name === null || stillSelected(name)) $("waits-summary").textContent = `Waits unavailable: ${err.message}`;
    }
  }

  function start() {
    $("waits-instance").addEventListener("change", tick);
    tick();
    setInterval(tick, EVERY_MS);
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
