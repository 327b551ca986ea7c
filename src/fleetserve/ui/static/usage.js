// Usage: requests and tokens per key and per model over time (GET /api/v1/usage), drawn as
// hand-made SVG line charts, with the totals per key and per model below.

import { POLL_MS, ApiError, api, el, empty, every, fmtNumber, section, svg, table } from "./core.js";

const RANGES = {
  "1h": { hours: 1, step: "minute" },
  "24h": { hours: 24, step: "hour" },
  "7d": { hours: 168, step: "day" },
};
const STEP_MS = { minute: 60e3, hour: 3600e3, day: 86400e3 };
const COLOURS = ["#2563eb", "#db2777", "#16a34a", "#ea580c", "#7c3aed", "#0891b2", "#ca8a04", "#dc2626"];
const H = 220;
const PAD = { left: 56, right: 12, top: 12, bottom: 28 };

// Series per group (key or model) over evenly spaced buckets, zero where no row.
export function seriesOf(rows, groupOf, valueOf, start, end, step) {
  const stepMs = STEP_MS[step];
  const first = Math.floor(start / stepMs) * stepMs;
  const buckets = [];
  for (let t = first; t <= end; t += stepMs) buckets.push(t);
  const series = new Map();
  for (const row of rows) {
    const group = groupOf(row);
    if (!series.has(group)) series.set(group, new Array(buckets.length).fill(0));
    const i = Math.floor((new Date(row.start).getTime() - first) / stepMs);
    if (i >= 0 && i < buckets.length) series.get(group)[i] += valueOf(row);
  }
  return { buckets, series };
}

function niceMax(value) {
  if (value <= 0) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  for (const m of [1, 2, 5, 10]) if (m * power >= value) return m * power;
  return 10 * power;
}

// A line per group; drawn at the width it is shown at (`width` px), so its text is never stretched.
function lineChart(title, { buckets, series }, step, width) {
  const W = width;
  const names = [...series.keys()].sort();
  const max = niceMax(Math.max(0, ...names.flatMap((n) => series.get(n))));
  const x = (i) => PAD.left + (buckets.length > 1 ? (i / (buckets.length - 1)) * (W - PAD.left - PAD.right) : 0);
  const y = (v) => H - PAD.bottom - (v / max) * (H - PAD.top - PAD.bottom);
  const grid = [0, 0.5, 1].map((f) => [
    svg("line", { x1: PAD.left, x2: W - PAD.right, y1: y(f * max), y2: y(f * max), class: "gridline" }),
    svg("text", { x: PAD.left - 6, y: y(f * max) + 4, "text-anchor": "end", class: "axis" }, fmtNumber(f * max)),
  ]);
  const label = (t) => {
    const d = new Date(t);
    return step === "day" ? d.toLocaleDateString() : d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
  };
  const ticks = buckets.length ? [0, Math.floor((buckets.length - 1) / 2), buckets.length - 1] : [];
  const anchor = (i) => (i === 0 ? "start" : i === buckets.length - 1 ? "end" : "middle");
  const xLabels = [...new Set(ticks)].map((i) => svg("text", { x: x(i), y: H - 8, "text-anchor": anchor(i), class: "axis" }, label(buckets[i])));
  const lines = names.map((name, n) =>
    svg("polyline", {
      points: series.get(name).map((v, i) => `${x(i).toFixed(1)},${y(v).toFixed(1)}`).join(" "),
      fill: "none",
      stroke: COLOURS[n % COLOURS.length],
      "stroke-width": 2,
      class: "series",
    }, svg("title", {}, name)),
  );
  const legend = el(
    "ul",
    { class: "legend" },
    names.map((name, n) => el("li", {}, el("span", { class: "swatch", "data-colour": COLOURS[n % COLOURS.length] }), name)),
  );
  for (const swatch of legend.querySelectorAll(".swatch")) swatch.style.background = swatch.dataset.colour;
  return el(
    "figure",
    { class: "chart" },
    el("figcaption", { text: title }),
    svg("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img", "aria-label": title }, grid, xLabels, lines),
    names.length ? legend : el("p", { class: "muted", text: "No requests in this range." }),
  );
}

function totals(rows, first) {
  return rows.map((r) => [first(r), fmtNumber(r.requests), fmtNumber(r.errors), fmtNumber(r.promptTokens), fmtNumber(r.completionTokens)]);
}

export function render(main, status) {
  const range = el("select", { id: "range" }, Object.keys(RANGES).map((k) => el("option", { value: k, text: `last ${k}` })));
  range.value = "1h";
  const groupBy = el("select", { id: "group-by" }, el("option", { value: "key", text: "per key" }), el("option", { value: "model", text: "per model" }));
  const body = el("div", { class: "stack", id: "usage" });
  let refresh = () => {};
  range.addEventListener("change", () => refresh());
  groupBy.addEventListener("change", () => refresh());
  main.append(
    el("h1", { text: "Usage" }),
    el("div", { class: "row" }, el("label", { for: "range", text: "Range" }), range, el("label", { for: "group-by", text: "Lines" }), groupBy),
    body,
  );
  refresh = every(
    POLL_MS * 5,
    async () => {
      const { hours, step } = RANGES[range.value];
      const end = Date.now();
      const start = end - hours * 3600e3;
      let usage;
      try {
        usage = await api("GET", `/usage?since=${encodeURIComponent(new Date(start).toISOString())}&step=${step}`);
      } catch (e) {
        if (e instanceof ApiError && e.status === 404) {
          body.replaceChildren(empty("No data: this server keeps no usage records."));
          return;
        }
        throw e;
      }
      const rows = usage.rows || [];
      const group = groupBy.value === "key" ? (r) => r.key || `key ${r.keyId}` : (r) => r.model;
      // The chart's inner width: the figure's, less its padding and border.
      const width = Math.max(280, body.clientWidth - 28);
      body.replaceChildren(
        lineChart("Requests", seriesOf(rows, group, (r) => r.requests, start, end, step), step, width),
        lineChart("Tokens (prompt + completion)", seriesOf(rows, group, (r) => r.promptTokens + r.completionTokens, start, end, step), step, width),
        section("Per key", ((usage.totals || {}).keys || []).length ? table(["Key", "Requests", "Errors", "Prompt tokens", "Completion tokens"], totals((usage.totals || {}).keys, (r) => r.key || `key ${r.keyId}`), { id: "usage-by-key" }) : empty("No requests.")),
        section("Per model", ((usage.totals || {}).models || []).length ? table(["Model", "Requests", "Errors", "Prompt tokens", "Completion tokens"], totals((usage.totals || {}).models, (r) => r.model), { id: "usage-by-model" }) : empty("No requests.")),
      );
    },
    status,
  );
}
