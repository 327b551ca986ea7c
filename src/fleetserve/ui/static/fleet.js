// Fleet: every node with its devices grouped by vendor and class, state, cordon, epoch,
// allocations, GPU utilisation/memory/power from the agents' samples, downloads; cordon,
// uncordon and drain.

import { POLL_MS, api, badge, el, empty, errorBox, every, fmtAgo, fmtBytes, fmtNumber, link } from "./core.js";

const GPU = {
  util: "fleetserve_gpu_utilization_ratio",
  memory: "fleetserve_gpu_memory_used_bytes",
  power: "fleetserve_gpu_power_watts",
  temperature: "fleetserve_gpu_temperature_celsius",
};

// Per device index, its latest samples by metric name.
function samplesByDevice(node) {
  const out = new Map();
  const samples = (node.status && node.status.agent && node.status.agent.gpuMetrics) || [];
  for (const s of samples) {
    const device = s.labels && s.labels.device;
    if (device === undefined) continue;
    if (!out.has(device)) out.set(device, {});
    out.get(device)[s.name] = s.value;
  }
  return out;
}

function meter(ratio, label) {
  const pct = Math.max(0, Math.min(1, ratio || 0)) * 100;
  return el(
    "span",
    { class: "meter", role: "meter", "aria-valuemin": "0", "aria-valuemax": "100", "aria-valuenow": pct.toFixed(0), "aria-label": label },
    el("span", { class: "meter-fill", style: null, "data-pct": pct.toFixed(0) }),
    el("span", { class: "meter-text", text: `${pct.toFixed(0)}%` }),
  );
}

// CSP forbids inline style attributes set from markup, but CSSOM writes are allowed.
function sized(node) {
  for (const fill of node.querySelectorAll(".meter-fill")) fill.style.width = `${fill.dataset.pct}%`;
  return node;
}

function deviceGroups(node, classes) {
  const groups = new Map();
  const held = new Set((node.status && node.status.allocatedDevices) || []);
  for (const d of node.devices || []) {
    const cls = classes.get(d.class);
    const vendor = cls ? cls.driver : "unknown";
    const key = `${vendor}\u0000${d.class}`;
    if (!groups.has(key)) groups.set(key, { vendor, cls: d.class, memory: cls ? cls.memory : null, count: 0, held: 0 });
    const g = groups.get(key);
    g.count += 1;
    if (held.has(d.index)) g.held += 1;
  }
  return [...groups.values()].sort((a, b) => (a.vendor + a.cls).localeCompare(b.vendor + b.cls));
}

function nodeCard(node, classes, actions) {
  const status = node.status || {};
  const agent = status.agent || {};
  const samples = samplesByDevice(node);
  const cordoned = Boolean(node.cordon);
  const head = el(
    "div",
    { class: "card-head" },
    el("h2", { text: node.name }),
    badge(node.state),
    cordoned ? badge("cordoned", "warn") : null,
    el("span", { class: "muted", text: `epoch ${status.epoch ?? 0} · heartbeat ${fmtAgo(status.lastHeartbeat)}` }),
  );
  const buttons = el(
    "div",
    { class: "actions" },
    cordoned
      ? el("button", { type: "button", class: "ghost", onclick: () => actions.uncordon(node.name), text: "Uncordon" })
      : el("button", { type: "button", class: "ghost", onclick: () => actions.ask("cordon", node.name), text: "Cordon…" }),
    el("button", { type: "button", class: "ghost danger", onclick: () => actions.ask("drain", node.name), text: "Drain…" }),
  );
  const facts = el(
    "dl",
    { class: "facts" },
    el("dt", { text: "CPU" }),
    el("dd", { text: `${node.cpu.cores} cores, ${fmtBytes(node.cpu.memory)}` }),
    el("dt", { text: "Address" }),
    el("dd", { text: node.address || "—" }),
    cordoned ? [el("dt", { text: "Cordon" }), el("dd", { class: "cordon-reason", text: `${node.cordon.reason} (by ${node.cordon.by})` })] : null,
    el("dt", { text: "Replicas" }),
    el(
      "dd",
      {},
      (status.replicas || []).length
        ? (status.replicas || []).flatMap((r, i) => [i ? ", " : "", link(`/ui/replica?name=${encodeURIComponent(r)}`, r)])
        : "none",
    ),
  );
  const groups = deviceGroups(node, classes);
  const devices = groups.length
    ? el(
        "ul",
        { class: "groups" },
        groups.map((g) =>
          el(
            "li",
            {},
            el("span", { class: "vendor", text: g.vendor }),
            ` ${g.count} × ${g.cls}`,
            g.memory ? el("span", { class: "muted", text: ` (${fmtBytes(g.memory)} each)` }) : null,
            el("span", { class: "muted", text: ` · ${g.held} allocated` }),
          ),
        ),
      )
    : el("p", { class: "muted", text: "CPU only: no accelerator devices" });
  const gpuRows = (node.devices || []).map((d) => {
    const s = samples.get(String(d.index)) || {};
    const memory = classes.get(d.class) ? classes.get(d.class).memory : null;
    const used = s[GPU.memory];
    const held = (status.allocatedDevices || []).includes(d.index);
    return el(
      "tr",
      {},
      el("td", { text: String(d.index) }),
      el("td", { text: d.class }),
      el("td", {}, held ? badge("allocated", "warn") : badge("free", "good")),
      el("td", {}, s[GPU.util] === undefined ? "—" : meter(s[GPU.util], `GPU ${d.index} utilisation`)),
      el("td", { text: used === undefined ? "—" : `${fmtBytes(used)}${memory ? " / " + fmtBytes(memory) : ""}` }),
      el("td", { text: s[GPU.power] === undefined ? "—" : `${fmtNumber(s[GPU.power])} W` }),
      el("td", { text: s[GPU.temperature] === undefined ? "—" : `${fmtNumber(s[GPU.temperature])} °C` }),
    );
  });
  const gpuTable = gpuRows.length
    ? el(
        "div",
        { class: "table-wrap" },
        el(
          "table",
          {},
          el("thead", {}, el("tr", {}, ["Device", "Class", "", "Utilisation", "Memory", "Power", "Temp."].map((h) => el("th", { text: h })))),
          el("tbody", {}, gpuRows),
        ),
      )
    : null;
  const downloads = (agent.downloads || []).map((d) => {
    const ratio = d.total ? d.done / d.total : 0;
    return el(
      "li",
      {},
      el("span", { text: `${d.model}: ${d.state} ` }),
      d.total ? meter(ratio, `download of ${d.model}`) : null,
      el("span", { class: "muted", text: ` ${fmtBytes(d.done)}${d.total ? " / " + fmtBytes(d.total) : ""}${d.rate ? ` at ${fmtBytes(d.rate)}/s` : ""}` }),
      d.error ? el("span", { class: "error", text: ` ${d.error}` }) : null,
    );
  });
  const problems = (agent.problems || []).map((p) => el("li", { class: "error", text: p }));
  // The engine builds its agent found; none reported (a YAML fleet's node): not filtered on them.
  const engines =
    node.engines == null
      ? el("p", { class: "muted", text: "not reported by an agent: placement does not filter on engines" })
      : node.engines.length
        ? el(
            "ul",
            { class: "plain" },
            node.engines.map((f) =>
              el(
                "li",
                {},
                el("span", { text: `${f.engine} ${f.version}` }),
                el("span", {
                  class: "muted",
                  text: ` · ${f.variants.length ? f.variants.join(", ") : "runs no variant here"}${f.devices.length ? " · sees " + f.devices.map((d) => d.name).join(", ") : ""}`,
                }),
              ),
            ),
          )
        : el("p", { class: "error", text: "its agent found no engine: no replica is placed here" });
  return sized(
    el(
      "article",
      { class: "card node", "data-node": node.name },
      head,
      facts,
      el("h3", { text: "Devices" }),
      devices,
      gpuTable,
      el("h3", { text: "Engines" }),
      engines,
      downloads.length ? [el("h3", { text: "Downloads" }), el("ul", { class: "plain" }, downloads)] : null,
      problems.length ? [el("h3", { text: "Problems" }), el("ul", { class: "plain" }, problems)] : null,
      buttons,
    ),
  );
}

function reasonDialog(refresh, notice) {
  const reason = el("input", { id: "reason", name: "reason", required: true, maxlength: "1000", autocomplete: "off" });
  const title = el("h2", {});
  const error = el("p", { class: "error", role: "alert", hidden: true });
  let action = null;
  let target = null;
  const dialog = el(
    "dialog",
    { id: "reason-dialog" },
    el(
      "form",
      {
        method: "dialog",
        onsubmit: async (event) => {
          event.preventDefault();
          try {
            await api("POST", `/nodes/${encodeURIComponent(target)}/${action}`, { reason: reason.value });
            dialog.close();
            notice(`${target}: ${action === "drain" ? "draining" : "cordoned"}`);
            refresh();
          } catch (e) {
            error.hidden = false;
            error.textContent = e.message;
          }
        },
      },
      title,
      el("label", { for: "reason", text: "Reason (shown to every operator)" }),
      reason,
      error,
      el(
        "div",
        { class: "actions" },
        el("button", { type: "submit", id: "reason-confirm", text: "Confirm" }),
        el("button", { type: "button", class: "ghost", onclick: () => dialog.close(), text: "Cancel" }),
      ),
    ),
  );
  return {
    dialog,
    ask(kind, name) {
      action = kind;
      target = name;
      title.textContent = kind === "drain" ? `Drain ${name}: move its replicas away` : `Cordon ${name}: keep new replicas off it`;
      reason.value = "";
      error.hidden = true;
      dialog.showModal();
      reason.focus();
    },
  };
}

export function render(main, status) {
  const list = el("div", { class: "grid" });
  const note = el("p", { class: "notice", role: "status", hidden: true });
  const summary = el("p", { class: "muted" });
  let refresh = () => {};
  const notice = (text) => {
    note.hidden = false;
    note.textContent = text;
  };
  const dialog = reasonDialog(() => refresh(), notice);
  const actions = {
    ask: (kind, name) => dialog.ask(kind, name),
    uncordon: async (name) => {
      try {
        await api("POST", `/nodes/${encodeURIComponent(name)}/uncordon`);
        notice(`${name}: uncordoned`);
      } catch (e) {
        notice(e.message);
      }
      refresh();
    },
  };
  main.append(el("h1", { text: "Fleet" }), summary, note, list, dialog.dialog);
  refresh = every(
    POLL_MS,
    async () => {
      try {
        const [nodes, classList] = await Promise.all([api("GET", "/nodes"), api("GET", "/classes")]);
        const classes = new Map(classList.map((c) => [c.name, c]));
        const devices = nodes.reduce((n, node) => n + (node.devices || []).length, 0);
        const ready = nodes.filter((n) => n.state === "Ready").length;
        summary.textContent = `${nodes.length} nodes (${ready} ready), ${devices} accelerator devices`;
        list.replaceChildren(...(nodes.length ? nodes.map((n) => nodeCard(n, classes, actions)) : [empty("No node has registered yet: start an agent with the join token.")]));
      } catch (e) {
        list.replaceChildren(errorBox(e));
        throw e;
      }
    },
    status,
  );
}
