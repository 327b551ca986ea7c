// Replica (?name=): state, restarts, the engine's log tail, its engine metrics.

import { POLL_MS, api, badge, el, empty, errorBox, every, fmtNumber, link, query, section, table } from "./core.js";

const LABELS = {
  fleetserve_requests_running: "Requests running",
  fleetserve_requests_waiting: "Requests waiting",
  fleetserve_kv_cache_usage_ratio: "KV cache in use",
  fleetserve_prompt_tokens_total: "Prompt tokens (total)",
  fleetserve_generation_tokens_total: "Generated tokens (total)",
};

function metricValue(name, value) {
  if (name.endsWith("_ratio")) return `${fmtNumber(value * 100, 1)}%`;
  return fmtNumber(value, 2);
}

export function render(main, status) {
  const name = query("name");
  if (!name) {
    main.append(el("h1", { text: "Replica" }), empty("Pick a replica from a deployment or a node."));
    return;
  }
  const head = el("div", { class: "card-head" });
  const body = el("div", { class: "stack" });
  main.append(head, body);
  const path = encodeURIComponent(name);
  every(
    POLL_MS,
    async () => {
      let replica;
      try {
        replica = await api("GET", `/replicas/${path}`);
      } catch (e) {
        head.replaceChildren(el("h1", { text: name }));
        body.replaceChildren(errorBox(e));
        return;
      }
      const [logs, metrics] = await Promise.all([api("GET", `/replicas/${path}/logs`), api("GET", `/replicas/${path}/metrics`)]);
      const st = replica.status || {};
      head.replaceChildren(
        el("h1", { text: replica.name }),
        el("span", { id: "replica-state" }, badge(replica.state)),
        el("span", {}, "of ", link(`/ui/deployments?name=${encodeURIComponent(replica.deployment)}`, replica.deployment)),
      );
      const shards = (replica.shards || []).map((s, i) => [String(i), s.node, (s.devices || []).join(", ") || "cpu", String(s.cpuCores ?? "—")]);
      const values = Object.entries(metrics.metrics || {});
      const tail = logs.lines || [];
      const pre = el("pre", { class: "log", id: "engine-log", tabindex: "0", text: tail.length ? tail.join("\n") : "(no output yet)" });
      body.replaceChildren(
        section(
          "State",
          el(
            "dl",
            { class: "facts" },
            el("dt", { text: "State" }),
            el("dd", { text: replica.state }),
            el("dt", { text: "Restarts" }),
            el("dd", { id: "restarts", text: String(logs.restarts ?? st.restarts ?? 0) }),
            el("dt", { text: "Profile" }),
            el("dd", { text: replica.profile }),
            el("dt", { text: "Port" }),
            el("dd", { text: st.port ? String(st.port) : "—" }),
            el("dt", { text: "In flight" }),
            el("dd", { text: st.inFlight === undefined ? "—" : String(st.inFlight) }),
            el("dt", { text: "Message" }),
            el("dd", { text: logs.message || "—" }),
          ),
        ),
        section("Shards", table(["Shard", "Node", "Devices", "CPU cores"], shards)),
        section(
          "Engine metrics",
          values.length ? table(["Metric", "Value"], values.map(([k, v]) => [LABELS[k] || k, metricValue(k, v)]), { id: "engine-metrics" }) : empty("No scrape yet (the engine is not Running, or not scraped by this server)."),
        ),
        section("Engine log (last lines)", pre),
      );
      pre.scrollTop = pre.scrollHeight;
    },
    status,
  );
}
