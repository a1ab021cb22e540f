// The Retraining page: every retraining pipeline the user may read, its gate metric per partition
// and its runs, each linking to its Training tab. Untrusted text only through textContent.
"use strict";
(function () {
  const data = document.body.dataset;
  const root = data.root, ui = data.ui;
  const $ = (id) => document.getElementById(id);

  function el(tag, text, attrs) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    return node;
  }

  function trainingTab(dagId, runId, task) {
    const enc = encodeURIComponent;
    const mapped = task.map_index >= 0 ? `/mapped/${task.map_index}` : "";
    return `${ui}/dags/${enc(dagId)}/runs/${enc(runId)}/tasks/${enc(task.task_id)}${mapped}/plugin/training`;
  }

  // The Airflow UI shows this page in a sandboxed iframe that may not navigate the top window. Same
  // origin, though: move the UI's own router (history + popstate), as its links do. Elsewhere (this
  // page opened on its own), follow the fallback, dtrain's own page for the same thing.
  function airflowLink(text, href, fallback, attrs) {
    const link = el("a", text, {href, ...attrs});
    link.addEventListener("click", (event) => {
      if (event.button !== 0 || event.ctrlKey || event.metaKey || event.shiftKey) return;
      event.preventDefault();
      try {
        if (window.top !== window && window.top.location.origin === window.location.origin) {
          window.top.history.pushState(null, "", href);
          window.top.dispatchEvent(new PopStateEvent("popstate", {state: null}));
          return;
        }
      } catch (e) { /* not the same origin */ }
      window.location.href = fallback || href;
    });
    return link;
  }

  // A link to the MLflow UI: the server built the address from the deployment's connection, never from
  // a recorded value; opened in a new tab (it is another application).
  function mlflowLink(text, href, cls) {
    return href ? el("a", text, {href, target: "_blank", rel: "noopener noreferrer", class: cls}) : el("span", text);
  }

  function registryCell(registered) {
    const cell = el("td");
    if (!registered) { cell.textContent = "-"; return cell; }
    cell.append(mlflowLink(`${registered.model_name} v${registered.version}`, registered.version_url, "mlflow-version"),
                " ", el("span", `@${registered.alias}`, {class: "alias"}));
    if (registered.run) cell.append(" ", mlflowLink("run", registered.run.url, "mlflow-run"));
    return cell;
  }

  function fmt(x) { return x === null || x === undefined ? "-" : Number(x).toPrecision(6).replace(/\.?0+$/, ""); }

  async function renderPipeline(p) {
    const box = el("section", null, {class: "pipeline", "data-dag-id": p.dag_id});
    const title = el("h2");
    title.append(airflowLink(p.dag_id, `${ui}/dags/${encodeURIComponent(p.dag_id)}`));
    box.append(title, el("p", `${p.metric || "no metric yet"} (${p.goal || "-"}): ${p.published} published, ` +
                              `${p.gated_out} gated out, ${p.runs.length} run(s)`, {class: "hint"}));
    const plot = el("div", null, {class: "plot"});
    box.append(plot);
    const table = el("table", null, {class: "runs"});
    const head = el("tr");
    for (const h of ["partition", "run", "outcome", p.metric || "metric", "published before", "why", "registered",
                     "training"]) {
      head.append(el("th", h));
    }
    table.append(el("thead"), el("tbody"));
    table.tHead.append(head);
    for (const r of p.runs) {
      const row = el("tr", null, {"data-run-id": r.run_id, "data-outcome": r.outcome});
      const cls = r.outcome === "published" ? "outcome-published" : r.outcome === "gated out" ? "outcome-gated-out" : "";
      const links = el("td");
      for (const task of r.training_tasks) {
        const own = `${root}/ti?` + new URLSearchParams({dag_id: p.dag_id, run_id: r.run_id, task_id: task.task_id,
                                                          map_index: task.map_index});
        links.append(airflowLink(task.task_id, trainingTab(p.dag_id, r.run_id, task), own,
                                 {class: "training-link"}), " ");
      }
      row.append(el("td", r.partition), el("td", r.run_id), el("td", r.outcome, {class: cls}), el("td", fmt(r.value)),
                 el("td", fmt(r.baseline)), el("td", r.reasons.join("; ")), registryCell(r.registered), links);
      table.tBodies[0].append(row);
    }
    box.append(table);
    $("pipelines").append(box);
    const response = await fetch(`${root}/api/retraining/plot.svg?dag_id=${encodeURIComponent(p.dag_id)}`,
                                 {credentials: "same-origin"});
    if (response.ok) plot.innerHTML = await response.text();  // our own SVG (matplotlib escapes its text)
  }

  async function load() {
    try {
      const response = await fetch(`${root}/api/retraining`, {credentials: "same-origin"});
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const pipelines = (await response.json()).pipelines;
      $("empty").hidden = pipelines.length > 0;
      await Promise.all(pipelines.map(renderPipeline));
      document.body.dataset.loaded = "true";
    } catch (e) {
      $("error").textContent = String(e.message || e);
      $("error").hidden = false;
    }
  }

  load();
})();
