// The dashboard's common ground: building elements (text only, never HTML), calling the admin
// API with the session's CSRF token, polling, and formatting numbers.

export const CSRF_COOKIE = "fs_csrf";
export const CSRF_HEADER = "X-CSRF-Token";
export const POLL_MS = 2000;

// An element with attributes and children; strings become text nodes, so data is never parsed
// as HTML. `on*` attributes given functions become event listeners.
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on") && typeof value === "function") {
      node.addEventListener(key.slice(2), value);
    } else if (key === "class") {
      node.className = value;
    } else if (key === "text") {
      node.textContent = String(value);
    } else {
      node.setAttribute(key, value === true ? "" : String(value));
    }
  }
  append(node, children);
  return node;
}

function append(node, children) {
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    if (Array.isArray(child)) append(node, child);
    else if (child instanceof Node) node.appendChild(child);
    else node.appendChild(document.createTextNode(String(child)));
  }
}

// An SVG element (charts); same rules as el().
export function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined) continue;
    node.setAttribute(key, String(value));
  }
  append(node, children);
  return node;
}

export function csrfToken() {
  for (const part of document.cookie.split(";")) {
    const [name, ...rest] = part.trim().split("=");
    if (name === CSRF_COOKIE) return decodeURIComponent(rest.join("="));
  }
  return "";
}

// An answer of the admin API that was not a success: its status and the server's message.
export class ApiError extends Error {
  constructor(status, message, problems = []) {
    super(message);
    this.status = status;
    this.problems = problems;
  }
}

// Call the admin API (path under /api/v1) with the session cookie; changes carry the CSRF token.
// A 401 means the session ended: back to the login page.
export async function api(method, path, body = undefined) {
  const headers = { Accept: "application/json" };
  if (method !== "GET" && method !== "HEAD") headers[CSRF_HEADER] = csrfToken();
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(`/api/v1${path}`, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    credentials: "same-origin",
  });
  if (response.status === 401) {
    window.location.assign("/ui/login");
    throw new ApiError(401, "the session ended: log in again");
  }
  const text = await response.text();
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = null;
  }
  if (!response.ok) {
    const error = (data && data.error) || {};
    const problems = error.problems || [];
    const detail = problems.map((p) => `${p.field ? p.field + ": " : ""}${p.message}`).join("; ");
    const message = `${error.message || response.statusText || "request failed"}${detail ? " — " + detail : ""}`;
    throw new ApiError(response.status, message, problems);
  }
  return data;
}

// Run `tick` now and every `ms` while the page is shown (a hidden tab is not polled; it catches
// up when shown again); a failing tick shows its error in `status` and the next one tries again.
// Returns a function that runs it at once.
export function every(ms, tick, status) {
  let timer = null;
  let running = false;
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) run();
  });
  async function run() {
    if (running) return;
    clearTimeout(timer);
    if (document.hidden) return;
    running = true;
    try {
      await tick();
      if (status) setStatus(status, "live", `updated ${new Date().toLocaleTimeString()}`);
    } catch (error) {
      if (status) setStatus(status, "stale", `update failed: ${error.message}`);
    } finally {
      running = false;
      timer = setTimeout(run, ms);
    }
  }
  run();
  return run;
}

function setStatus(node, kind, text) {
  node.className = `live ${kind}`;
  node.textContent = text;
}

export function section(title, ...children) {
  return el("section", { class: "card" }, el("h2", { text: title }), ...children);
}

// A table of rows (arrays of cells: strings, numbers or nodes), with a caption for screen readers.
export function table(headers, rows, attrs = {}) {
  return el(
    "div",
    { class: "table-wrap" },
    el(
      "table",
      attrs,
      el("thead", {}, el("tr", {}, headers.map((h) => el("th", { scope: "col", text: h })))),
      el(
        "tbody",
        {},
        rows.map((row) => el("tr", {}, row.map((cell) => el("td", {}, cell ?? "")))),
      ),
    ),
  );
}

export function badge(text, kind = "") {
  return el("span", { class: `badge ${kind || badgeKind(text)}`, text });
}

const GOOD = new Set(["Ready", "Running", "True", "Placed", "done", "complete"]);
const BAD = new Set(["Lost", "Failed", "CrashLoop", "Failing", "False", "Unschedulable", "error", "revoked"]);
const WARN = new Set(["NotReady", "Pending", "Starting", "Draining", "Degraded", "cordoned", "downloading"]);

export function badgeKind(text) {
  if (GOOD.has(text)) return "good";
  if (BAD.has(text)) return "bad";
  if (WARN.has(text)) return "warn";
  return "";
}

export function empty(text) {
  return el("p", { class: "muted empty", text });
}

export function errorBox(error) {
  return el("p", { class: "error", role: "alert", text: error.message || String(error) });
}

export function fmtBytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = Number(n);
  let i = 0;
  while (value >= 1024 && i < units.length - 1) {
    value /= 1024;
    i += 1;
  }
  return `${value.toFixed(value >= 10 || i === 0 ? 0 : 1)} ${units[i]}`;
}

export function fmtNumber(n, digits = 0) {
  if (n === null || n === undefined || Number.isNaN(n)) return "—";
  return Number(n).toLocaleString(undefined, { maximumFractionDigits: digits });
}

export function fmtAgo(iso) {
  if (!iso) return "never";
  const seconds = (Date.now() - new Date(iso).getTime()) / 1000;
  if (seconds < 2) return "just now";
  if (seconds < 90) return `${Math.round(seconds)} s ago`;
  if (seconds < 5400) return `${Math.round(seconds / 60)} min ago`;
  if (seconds < 129600) return `${Math.round(seconds / 3600)} h ago`;
  return new Date(iso).toLocaleString();
}

export function fmtTime(iso) {
  return iso ? new Date(iso).toLocaleString() : "—";
}

export function link(href, text) {
  return el("a", { href, text });
}

export function query(name) {
  return new URLSearchParams(window.location.search).get(name);
}

// A deployment's summary state: Running when every desired replica runs; else Failing when a
// replica failed or crash-loops, Pending while none runs, Degraded in between.
export function deploymentState(dep, replicas) {
  const desired = dep.status && dep.status.desiredReplicas !== undefined ? dep.status.desiredReplicas : null;
  const running = replicas.filter((r) => r.state === "Running").length;
  if (desired === 0) return { text: "Scaled to zero", running, desired };
  if (desired !== null && running >= desired) return { text: "Running", running, desired };
  if (replicas.some((r) => r.state === "Failed" || r.state === "CrashLoop")) return { text: "Failing", running, desired };
  if (running === 0) return { text: "Pending", running, desired };
  return { text: "Degraded", running, desired };
}
