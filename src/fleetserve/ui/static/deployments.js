// Deployments: the list, and one deployment in detail (?name=): its replicas with profile, node
// and devices; conditions; the placement explanation; rollout state; the decision and
// autoscaler logs. Endpoints (servers fleetserve did not start) beside them, with their health.

import {
  POLL_MS,
  api,
  badge,
  deploymentState,
  el,
  empty,
  errorBox,
  every,
  fmtAgo,
  fmtTime,
  link,
  query,
  section,
  table,
} from "./core.js";

function replicaRows(replicas) {
  return replicas.map((r) => [
    link(`/ui/replica?name=${encodeURIComponent(r.name)}`, r.name),
    r.profile,
    (r.shards || []).map((s) => s.node).join(", "),
    (r.shards || []).map((s) => (s.devices && s.devices.length ? `${s.node}[${s.devices.join(",")}]` : "cpu")).join(" "),
    r.revision || "—",
    badge(r.state),
  ]);
}

// A profile's speculative decoding: its draft model (or n-gram lookup) and tokens guessed ahead.
function speculativeText(spec) {
  if (!spec) return "—";
  const source = spec.method === "ngram" ? "n-gram lookup" : `draft ${spec.draft}`;
  return `${source}, ${spec.tokens} tokens`;
}

// The deployment's profiles in placement order as written: engine, where it runs, speculative.
function profileRows(profiles) {
  return (profiles || []).map((p) => [
    p.name,
    p.engine + (p.runtime ? `/${p.runtime}` : ""),
    p.deviceClass ? `${p.devicesPerNode || 1}× ${p.deviceClass}` : "cpu",
    p.context ? String(p.context) : "model's",
    el("span", { class: "speculative", text: speculativeText(p.speculative) }),
  ]);
}

// The deployment's LoRA adapters, as listed: the base model, format and source of each.
function adapterRows(names, adapters) {
  const known = new Map(adapters.map((a) => [a.name, a]));
  return names.map((name) => {
    const a = known.get(name);
    return a ? [name, a.base, a.format, a.source] : [name, "—", "not defined", "—"];
  });
}

// Endpoints as replicas are shown: name, where, what it serves, weight, health.
function endpointRows(endpoints) {
  return endpoints.map((e) => [
    e.name,
    e.url,
    (e.models || []).map((m) => (m.name === m.upstream ? m.name : `${m.name} → ${m.upstream}`)).join(", "),
    String(e.weight),
    badge(e.status.state),
    e.status.lastError || "",
    e.status.checkedAt ? fmtAgo(e.status.checkedAt) : "never",
  ]);
}

function endpointTable(endpoints) {
  return table(["Endpoint", "URL", "Models", "Weight", "State", "Last error", "Checked"], endpointRows(endpoints), { id: "endpoints" });
}

function listPage(main, status) {
  const body = el("div", {});
  main.append(el("h1", { text: "Deployments" }), body);
  every(
    POLL_MS,
    async () => {
      const [deps, replicas, endpoints] = await Promise.all([
        api("GET", "/deployments"),
        api("GET", "/replicas"),
        api("GET", "/endpoints"),
      ]);
      const outside = endpoints.length ? section("Endpoints", endpointTable(endpoints)) : null;
      if (!deps.length) {
        body.replaceChildren(empty("No deployment yet: `fleetserve apply -f` one."), outside || "");
        return;
      }
      const rows = deps.map((d) => {
        const own = replicas.filter((r) => r.deployment === d.name);
        const state = deploymentState(d, own);
        return [
          link(`/ui/deployments?name=${encodeURIComponent(d.name)}`, d.name),
          d.model,
          d.task || "generate",
          badge(state.text),
          `${state.running}/${state.desired ?? "?"}`,
          (d.profiles || []).map((p) => `${p.name} (${p.engine}${p.deviceClass ? ", " + p.deviceClass : ""})`).join(", "),
          scheduledMessage(d.status),
        ];
      });
      body.replaceChildren(
        table(["Name", "Model", "Task", "State", "Running", "Profiles", "Placement"], rows, { id: "deployments" }),
        outside || "",
      );
    },
    status,
  );
}

function scheduledMessage(status) {
  const cond = ((status && status.conditions) || []).find((c) => c.type === "Scheduled");
  return cond ? cond.message : "not reconciled yet";
}

function reasonList(report) {
  return el(
    "ul",
    { class: "reasons" },
    (report.reasons || []).map((r) =>
      el(
        "li",
        {},
        el("strong", { text: String(r.count) }),
        ` ${r.reason}${r.have !== null && r.have !== undefined ? ` (have ${r.have})` : ""}`,
        el("span", { class: "muted", text: r.exhausted ? " — full now" : " — can never fit" }),
      ),
    ),
  );
}

// One profile's attempt: "0/N nodes fit" with the counts behind it.
function profileReport(report, verdict) {
  return el(
    "div",
    { class: "report" },
    el(
      "p",
      {},
      el("strong", { text: `Profile ${report.profile}` }),
      ` (${report.deviceClass || "cpu"}, ${report.devicesNeeded} per node × ${report.nodesNeeded} node${report.nodesNeeded === 1 ? "" : "s"}): `,
      el("span", { class: "fit", text: `${report.nodesFit}/${report.nodesEvaluated} nodes fit` }),
      verdict ? el("span", { class: "muted", text: ` — ${verdict}` }) : null,
    ),
    reasonList(report),
    el("p", { class: "message muted", text: report.message }),
  );
}

function accepted(decision) {
  const cond = (decision.conditions || []).find((c) => c.type === "Accepted");
  return cond && cond.message ? cond.message : "see the Accepted condition.";
}

function explanation(explain) {
  const decision = explain.decision;
  if (!decision) return empty("No placement decision recorded yet.");
  const parts = [el("p", { class: "muted", text: `Decided ${fmtAgo(explain.decidedAt)} for generation ${explain.generation}.` })];
  for (const p of decision.placed || []) {
    parts.push(
      el(
        "div",
        { class: "placed" },
        el(
          "p",
          {},
          badge("Placed"),
          " ",
          el("strong", { text: p.replica }),
          ` on profile ${p.profile}: `,
          (p.shards || []).map((s) => `${s.node}${s.devices && s.devices.length ? "[" + s.devices.join(",") + "]" : ""}`).join(", "),
        ),
        Object.keys(p.scores || {}).length
          ? el("p", { class: "muted", text: `scores: ${Object.entries(p.scores).map(([k, v]) => `${k} ${Number(v).toFixed(2)}`).join(", ")}` })
          : null,
        (p.skipped || []).map((r) => profileReport(r, "skipped: tried first, did not fit")),
      ),
    );
  }
  for (const u of decision.unplaced || []) {
    parts.push(
      el(
        "div",
        { class: "unplaced" },
        el("p", {}, badge("Unschedulable"), " ", el("strong", { text: u.replica }), " could not be placed:"),
        (u.reports || []).length ? u.reports.map((r) => profileReport(r, "")) : empty(`No profile may be used: ${accepted(decision)}`),
      ),
    );
  }
  const moreUnplaced = (decision.unplacedTotal || 0) - (decision.unplaced || []).length;
  if (moreUnplaced > 0) parts.push(el("p", { class: "unplaced", text: `… and ${moreUnplaced} more unschedulable (the record explains the first ${(decision.unplaced || []).length})` }));
  if (decision.kept && decision.kept.length) parts.push(el("p", { class: "muted", text: `Kept running: ${decision.kept.join(", ")}` }));
  if (decision.lost && decision.lost.length) parts.push(el("p", { text: `Replaced (node lost): ${decision.lost.join(", ")}` }));
  if (decision.surplus && decision.surplus.length) parts.push(el("p", { text: `Surplus, stopping: ${decision.surplus.join(", ")}` }));
  return el("div", { id: "explanation" }, parts);
}

function keyValues(obj) {
  const entries = Object.entries(obj || {});
  if (!entries.length) return empty("none");
  return el("dl", { class: "facts" }, entries.map(([k, v]) => [el("dt", { text: k }), el("dd", { text: typeof v === "object" && v !== null ? JSON.stringify(v) : String(v) })]));
}

function decisionSummary(d) {
  const placed = (d.placed || []).map((p) => `${p.replica} → ${p.profile}`);
  const unplaced = (d.unplaced || []).map((u) => `${u.replica} unschedulable`);
  const more = (d.unplacedTotal || 0) - (d.unplaced || []).length;
  if (more > 0) unplaced.push(`${more} more unschedulable`);
  const scheduled = (d.conditions || []).find((c) => c.type === "Scheduled");
  return [...placed, ...unplaced].join("; ") || (scheduled ? scheduled.message : "no change");
}

function detailPage(main, status, name) {
  const head = el("div", { class: "card-head" });
  const body = el("div", { class: "stack" });
  main.append(el("p", {}, link("/ui/deployments", "← all deployments")), head, body);
  const path = encodeURIComponent(name);
  every(
    POLL_MS,
    async () => {
      let dep;
      try {
        dep = await api("GET", `/deployments/${path}`);
      } catch (e) {
        head.replaceChildren(el("h1", { text: name }));
        body.replaceChildren(errorBox(e));
        return;
      }
      const [explain, decisions, endpoints, adapters] = await Promise.all([
        api("GET", `/deployments/${path}/explain`),
        api("GET", `/decisions?deployment=${path}&limit=20`),
        api("GET", "/endpoints"),
        (dep.adapters || []).length ? api("GET", "/adapters") : [],
      ]);
      const listed = endpoints.filter((e) => (dep.endpoints || []).includes(e.name));
      const replicas = dep.replicas || [];
      const state = deploymentState(dep, replicas);
      const st = dep.status || {};
      head.replaceChildren(
        el("h1", { text: dep.name }),
        el("span", { id: "deployment-state" }, badge(state.text)),
        el("span", { class: "muted", text: `model ${dep.model} · ${state.running}/${state.desired ?? "?"} running · generation ${dep.generation} · revision ${dep.revision}` }),
        // What it serves (an omitted task is generate).
        el("span", { id: "deployment-task", class: "muted", text: `task ${dep.task || "generate"}` }),
      );
      const conditions = (st.conditions || []).map((c) => [c.type, badge(String(c.status)), c.reason, c.message]);
      const autoscaler = (st.autoscaler || []).slice().reverse().map((e) => [
        e.at ? fmtTime(typeof e.at === "number" ? new Date(e.at * 1000).toISOString() : e.at) : "—",
        String(e.desired ?? "—"),
        e.reason || "—",
        e.detail || "",
        e.repeats > 1 ? `×${e.repeats}` : "",
      ]);
      body.replaceChildren(
        section("Profiles", table(["Profile", "Engine", "Runs on", "Context", "Speculative"], profileRows(dep.profiles), { id: "profiles" })),
        section("Replicas", replicas.length ? table(["Replica", "Profile", "Node", "Devices", "Revision", "State"], replicaRows(replicas), { id: "replicas" }) : empty("No replica placed.")),
        listed.length ? section("Endpoints", endpointTable(listed)) : "",
        (dep.adapters || []).length
          ? section("Adapters", table(["Adapter", "Base", "Format", "Source"], adapterRows(dep.adapters, adapters), { id: "adapters" }))
          : "",
        section("Conditions", conditions.length ? table(["Type", "Status", "Reason", "Message"], conditions) : empty("Not reconciled yet.")),
        section("Placement explanation", explanation(explain)),
        section("Rollout", keyValues(st.rollout)),
        section("Failures", keyValues(st.failures)),
        section(
          "Decision log",
          decisions.length ? table(["When", "What"], decisions.map((d) => [fmtTime(d.createdAt), decisionSummary(d.decision)])) : empty("No decision recorded."),
        ),
        section("Autoscaler log", autoscaler.length ? table(["When", "Desired", "Reason", "Detail", ""], autoscaler) : empty(dep.autoscale ? "No autoscaler decision yet." : "Not autoscaled.")),
      );
    },
    status,
  );
}

export function render(main, status) {
  const name = query("name");
  if (name) detailPage(main, status, name);
  else listPage(main, status);
}
