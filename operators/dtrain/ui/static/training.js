// The Training tab: fills the page from dtrain's JSON API and, while the job runs, refreshes the
// curves, verdicts and each rank's last lines every 2 s without reloading the page.
// Untrusted text (rank output, paths) only ever goes through textContent.
"use strict";
(function () {
  const data = document.body.dataset;
  const root = data.root;
  const ti = new URLSearchParams({dag_id: data.dag_id, run_id: data.run_id, task_id: data.task_id,
                                  map_index: data.map_index});
  const REFRESH_MS = 2000;
  const $ = (id) => document.getElementById(id);
  document.body.dataset.pageInstance = String(Math.random()).slice(2);
  document.body.dataset.refreshes = "0";

  function api(path, extra) {
    const query = new URLSearchParams(ti);
    for (const [k, v] of Object.entries(extra || {})) query.set(k, v);
    return `${root}/api/ti/${path}?${query}`;
  }

  async function fetchOk(url) {
    const response = await fetch(url, {credentials: "same-origin"});
    if (!response.ok) {
      // The API says why (a run directory refused by its provenance check, say): shown as text.
      let detail = "";
      try { detail = (await response.json()).detail; } catch (e) { /* not JSON */ }
      detail = typeof detail === "string" ? detail : detail ? JSON.stringify(detail) : "";
      throw new Error(`${url.split("?")[0]}: HTTP ${response.status}${detail ? ": " + detail : ""}`);
    }
    return response;
  }

  function el(tag, text, attrs) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    return node;
  }

  function show(id, visible) { $(id).hidden = !visible; }

  function seconds(s) {
    if (s === null || s === undefined) return "-";
    return s >= 120 ? `${(s / 60).toFixed(1)} min` : `${Number(s).toFixed(1)} s`;
  }

  function bytes(n) {
    const units = ["B", "KB", "MB", "GB", "TB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
  }

  function when(epoch) { return epoch ? new Date(epoch * 1000).toISOString().replace("T", " ").slice(0, 19) : "-"; }

  function renderSummary(view) {
    const job = view.job, t = view.ti, result = view.result || {};
    const list = $("summary-list");
    list.replaceChildren();
    const rows = [
      ["backend", job.backend], ["shape", Number.isInteger(job.min_nodes)
        ? `elastic: ${job.min_nodes} to ${job.nodes} node(s) x ${job.procs_per_node} proc(s), at most ${job.world_size} ranks`
        : `${job.nodes} node(s) x ${job.procs_per_node} proc(s) = ${job.world_size} ranks`],
      ["distribution", job.distribution], ["task state", t.state], ["try", t.try_number],
      ["duration", seconds(result.duration_s !== undefined ? result.duration_s : t.duration_s)],
      ["exit code", result.exit_code !== undefined ? result.exit_code
        : view.failure ? view.failure.exit_code : view.hang ? 124 : "-"],
      ["steps logged", view.steps === null || view.steps === undefined ? "-"
        : view.stall && view.stall.warmup_steps ? `${view.steps} (the verdicts leave out each rank's first ` +
          `${view.stall.warmup_steps}, its warm-up)` : view.steps],
      ["ranks reporting", (view.ranks_reporting || []).length],
      ["run directory", job.run_dir], ["job id", result.job_id || "-"],
    ];
    for (const [label, value] of rows) {
      list.append(el("dt", label), el("dd", value, {"data-field": label.replace(/ /g, "-")}));
    }
    if (view.mlflow_run) {  // the server built the address from the deployment's MLflow connection
      const run = view.mlflow_run, dd = el("dd", null, {"data-field": "mlflow-run"});
      dd.append(run.url ? el("a", run.run_id, {href: run.url, target: "_blank", rel: "noopener noreferrer"})
                        : el("span", run.run_id));
      list.append(el("dt", "MLflow run"), dd);
    }
    list.dataset.steps = view.steps === null || view.steps === undefined ? "-1" : String(view.steps);
    // Folders holding more entries than the API reads (a rank may fill one): what was not read is said.
    const unread = $("unread");
    unread.replaceChildren();
    for (const u of view.unread || []) unread.append(el("li", u.message, {"data-folder": u.folder, "data-more": u.more}));
    unread.hidden = !unread.children.length;
    show("summary", true);
  }

  function renderFailure(view) {
    const f = view.failure;
    if (!f || view.hang) { show("failure", false); return; }
    $("failure-text").textContent =
      `rank ${f.rank} (node ${f.node_rank}, local rank ${f.local_rank}) on ${f.host} failed first with exit code ` +
      `${f.exit_code} at ${when(f.time)}; its last lines:`;
    $("failure").dataset.rank = String(f.rank);
    $("failure-tail").textContent = (f.tail || []).join("\n");
    show("failure", true);
  }

  function renderHang(view) {
    const h = view.hang;
    if (!h) { show("hang", false); return; }
    $("hang").dataset.stuckRanks = (h.stuck_ranks || []).join(",");
    $("hang-text").textContent = h.message ||
      `rank(s) ${(h.stuck_ranks || []).join(", ")} stuck (${h.reason}); no progress for ${h.timeout_s} s`;
    const links = $("stack-links");
    const shown = [...links.querySelectorAll("details")].map((d) => d.dataset.rank).join(",");
    if (shown !== (view.stacks || []).join(",")) {
      links.replaceChildren();
      for (const rank of view.stacks || []) {
        // Inline: the Airflow UI's iframe sandbox allows no new window. The raw text stays one link away.
        const stuck = (h.stuck_ranks || []).includes(rank) ? " (stuck)" : "";
        const details = el("details", null, {"data-rank": rank});
        const pre = el("pre", null, {class: "tail stack"});
        details.append(el("summary", `rank ${rank} stack dump${stuck}`), pre);
        details.addEventListener("toggle", async () => {
          if (!details.open || pre.dataset.loaded) return;
          pre.textContent = (await (await fetchOk(api("stack", {rank}))).text());
          pre.dataset.loaded = "true";
        });
        const item = el("li");
        item.append(details, el("a", "raw text", {href: api("stack", {rank}), class: "raw", "data-rank": rank}));
        links.append(item);
      }
    }
    show("hang", true);
  }

  function renderStall(view) {
    const stall = view.stall;
    if (!stall || !stall.ranks || !stall.ranks.length) { show("stall", false); return; }
    const verdicts = $("verdicts");
    verdicts.replaceChildren();
    const cpu = stall.rules.CPUBottleneck, lb = stall.rules.LoadBalancing, comm = stall.rules.CommunicationBound;
    const pct = (x) => `${(100 * x).toFixed(1)}%`;
    const items = [
      ["CPUBottleneck", cpu.triggered,
       cpu.triggered ? `triggered on rank(s) ${cpu.ranks.join(", ")}: waiting for data up to ` +
         `${pct(cpu.max_data_wait_fraction)} of step time (threshold ${pct(cpu.threshold)}); preprocess before ` +
         "training (dtrain preprocess) or add DataLoader workers"
         : `ok: at most ${pct(cpu.max_data_wait_fraction)} of step time waiting for data (threshold ${pct(cpu.threshold)})`],
      ["LoadBalancing", lb.triggered, lb.message],
      ["CommunicationBound", comm.triggered, comm.message],
    ];
    for (const [rule, triggered, text] of items) {
      const item = el("li", null, {"data-rule": rule, "data-triggered": String(triggered)});
      item.append(el("span", rule + ": ", {class: triggered ? "verdict-triggered" : "verdict-ok"}), el("span", text));
      verdicts.append(item);
    }
    $("warmup").textContent = stall.warmup_steps ? `Each rank's first ${stall.warmup_steps} steps (its warm-up: ` +
      "worker start-up, cold caches) are left out of the verdicts and of this table." : "";
    const body = $("rank-table").querySelector("tbody");
    body.replaceChildren();
    for (const r of stall.ranks) {
      const row = el("tr", null, {"data-rank": r.rank});
      for (const cell of [r.rank, r.node === null ? "-" : r.node, r.steps, `${(r.median_step_time_s * 1000).toFixed(2)} ms`,
                          r.median_compute_time_s === null ? "-" : `${(r.median_compute_time_s * 1000).toFixed(2)} ms`,
                          pct(r.data_wait_fraction), r.comm_wait_fraction === null ? "-" : pct(r.comm_wait_fraction),
                          r.samples_per_s === null ? "-" : Number(r.samples_per_s).toFixed(1)]) {
        row.append(el("td", cell));
      }
      body.append(row);
    }
    show("stall", true);
  }

  function renderRounds(view) {
    // An elastic job's rounds, from its result (the server validated them; none while it runs).
    const rounds = Array.isArray(view.rounds) ? view.rounds : [];
    const body = $("round-table").querySelector("tbody");
    body.replaceChildren();
    for (const r of rounds) {
      const row = el("tr", null, {"data-round": r.round});
      for (const cell of [r.round, (r.nodes || []).join(", "), r.world_size, r.resume_step]) row.append(el("td", cell));
      body.append(row);
    }
    $("rounds").dataset.count = String(rounds.length);
    show("rounds", rounds.length > 0);
  }

  function renderCheckpoints(view) {
    const body = $("checkpoint-table").querySelector("tbody");
    body.replaceChildren();
    for (const c of view.checkpoints || []) {
      const row = el("tr", null, {"data-step": c.step});
      for (const cell of [c.step, c.name, c.size_bytes == null ? "" : bytes(c.size_bytes), when(c.time)]) row.append(el("td", cell));
      body.append(row);
    }
    show("checkpoints", (view.checkpoints || []).length > 0);
  }

  async function renderPlots() {
    await Promise.all([...document.querySelectorAll(".plot")].map(async (div) => {
      const response = await fetchOk(api(`plot/${div.dataset.curve}.svg`));
      // Our own SVG, drawn by matplotlib on the server (text in it is XML-escaped there).
      div.innerHTML = await response.text();
    }));
    show("plots", true);
  }

  async function renderTails() {
    const logs = await (await fetchOk(api("logs"))).json(), tails = logs.tails;
    const list = $("tail-list");
    list.replaceChildren();
    for (const u of logs.unread || []) list.append(el("p", u.message, {class: "error", "data-folder": u.folder}));
    show("tails", list.children.length + Object.keys(tails).length > 0);  // laid out first: a hidden box has no scroll height
    for (const rank of Object.keys(tails).sort((a, b) => a - b)) {
      const box = el("div", null, {class: "rank-tail", "data-rank": rank});
      const pre = el("pre", tails[rank].join("\n"), {class: "tail"});
      box.append(el("h3", `rank ${rank}`), pre);
      list.append(box);
      pre.scrollTop = pre.scrollHeight;  // the newest line in view, as tail -f
    }
  }

  async function refresh() {
    const view = await (await fetchOk(api("summary"))).json();
    $("title").textContent = `Training: ${view.ti.dag_id} / ${view.ti.task_id}`;
    const state = $("state");
    state.textContent = view.state;
    state.dataset.state = view.state;
    if (!view.job) { show("no-job", true); return false; }
    renderSummary(view);
    renderFailure(view);
    renderHang(view);
    renderStall(view);
    renderRounds(view);
    renderCheckpoints(view);
    await Promise.all([renderPlots(), renderTails()]);
    document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes) + 1);
    return view.state === "running";
  }

  async function loop() {
    let running = false;
    try {
      running = await refresh();
      show("error", false);
    } catch (e) {
      $("error").textContent = String(e.message || e);
      show("error", true);
      running = true;  // a transient error (API restart): try again
    }
    show("live", running);
    if (running) setTimeout(loop, REFRESH_MS);
  }

  loop();
})();
