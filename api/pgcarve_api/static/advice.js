/* pgcarve dashboard: "Does carving help on this host?" (GET /v1/advice every 10 s).
 *
 * The newest finished advice run (POST /v1/advice, or its operation in the Operations panel while
 * it runs): its verdict, the reason, the caveat (emulation), and a link to its HTML report.
 * Strings from the API are rendered with textContent only.
 */
(() => {
  "use strict";

  const EVERY_MS = 10000;
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

  function show(run) {
    const verdict = $("advice-verdict");
    $("advice-empty").hidden = Boolean(run);
    $("advice-result").hidden = !run;
    if (!run) return;
    verdict.textContent = run.headline || "no verdict";
    verdict.className = `advice-verdict advice-${(run.word || "none").replace(/[^a-z]+/g, "-")}`;
    $("advice-reason").textContent = run.reason || "";
    $("advice-caveat").textContent = run.caveat || "";
    $("advice-caveat").hidden = !run.caveat;
    const when = [run.host ? `host ${run.host}` : "", run.finished_at ? `finished ${run.finished_at}` : "",
      run.host_left_as_it_was === false ? "something was left behind" : ""].filter(Boolean).join(", ");
    $("advice-when").textContent = when;
    const link = $("advice-report");
    // Only the API's own report path: never a link the document could point elsewhere.
    link.href = /^\/v1\/advice\/[0-9a-f]{12}\/report$/.test(run.report || "") ? run.report : "#";
  }

  async function load() {
    try {
      const runs = await getJson("/v1/advice");
      show(runs.length ? runs[0] : null);
    } catch { /* the connection line in dashboard.js already says the API is away */ }
  }

  document.addEventListener("DOMContentLoaded", () => {
    load();
    setInterval(load, EVERY_MS);
  });
})();
