// Playground: chat with a deployment through this server's own gateway (/v1/chat/completions),
// streamed with fetch and a reader, with time to first token and tokens per second.
//
// The gateway takes API keys, not the dashboard's session. The page uses a key the operator
// pastes, or creates a playground key limited to the chosen deployment (POST /api/v1/keys, shown
// on the Keys page as playground-…, revocable there or here). Its secret stays in this tab's
// sessionStorage only: gone when the tab closes, never in localStorage or a cookie.

import { api, el, empty, errorBox, fmtNumber } from "./core.js";

const STORE = "fleetserve.playground.keys";
const MAX_TOKENS = 256;

function savedKeys() {
  try {
    return JSON.parse(sessionStorage.getItem(STORE) || "{}");
  } catch {
    return {};
  }
}

function saveKey(deployment, value) {
  const keys = savedKeys();
  if (value) keys[deployment] = value;
  else delete keys[deployment];
  sessionStorage.setItem(STORE, JSON.stringify(keys));
}

// The data lines of a server-sent event stream, as they complete.
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
      for (const line of event.split(/\r?\n/)) {
        if (line.startsWith("data:")) yield line.slice(5).trim();
      }
    }
  }
}

export function render(main, status) {
  status.textContent = "";
  const select = el("select", { id: "deployment", name: "deployment" });
  const keyInput = el("input", { id: "api-key", type: "password", autocomplete: "off", placeholder: "fs_key_… (or create one)", maxlength: "200" });
  const keyNote = el("p", { class: "muted", id: "key-note" });
  const log = el("div", { class: "chat", id: "chat", "aria-live": "polite" });
  const prompt = el("textarea", { id: "prompt", rows: "3", maxlength: "20000", placeholder: "Say something…" });
  const send = el("button", { type: "submit", id: "send", text: "Send" });
  const stats = el("p", { class: "stats", id: "stats", text: "Time to first token: — · tokens/s: —" });
  const error = el("div", {});
  const history = [];

  function showKey() {
    const saved = savedKeys()[select.value];
    keyInput.value = saved ? saved.key : "";
    keyNote.textContent = saved && saved.id ? `Playground key ${saved.name} (id ${saved.id}), limited to ${select.value}, kept in this tab only.` : "";
  }

  async function createKey() {
    error.replaceChildren();
    const deployment = select.value;
    if (!deployment) return;
    try {
      const stamp = new Date().toISOString().replace(/[^0-9]/g, "").slice(0, 14);
      const made = await api("POST", "/keys", { name: `playground-${stamp}`, models: [deployment] });
      saveKey(deployment, { id: made.id, name: made.name, key: made.key });
      showKey();
    } catch (e) {
      error.replaceChildren(errorBox(e));
    }
  }

  async function revokeKey() {
    error.replaceChildren();
    const saved = savedKeys()[select.value];
    if (saved && saved.id) {
      try {
        await api("DELETE", `/keys/${saved.id}`);
      } catch (e) {
        error.replaceChildren(errorBox(e));
      }
    }
    saveKey(select.value, null);
    showKey();
  }

  function bubble(role, text) {
    const body = el("div", { class: "bubble-text", text });
    const node = el("div", { class: `bubble ${role}` }, el("span", { class: "role", text: role }), body);
    log.append(node);
    log.scrollTop = log.scrollHeight;
    return body;
  }

  async function chat(event) {
    event.preventDefault();
    error.replaceChildren();
    const content = prompt.value.trim();
    const key = keyInput.value.trim();
    if (!content) return;
    if (!select.value) {
      error.replaceChildren(errorBox(new Error("Choose a deployment first.")));
      return;
    }
    if (!key) {
      error.replaceChildren(errorBox(new Error("An API key is needed: paste one, or create a playground key.")));
      return;
    }
    history.push({ role: "user", content });
    bubble("user", content);
    prompt.value = "";
    const answer = bubble("assistant", "");
    answer.parentElement.classList.add("streaming");
    send.disabled = true;
    const started = performance.now();
    let first = null;
    let chunks = 0;
    let usage = null;
    let text = "";
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json", Authorization: `Bearer ${key}` },
        body: JSON.stringify({ model: select.value, messages: history, stream: true, max_tokens: MAX_TOKENS, stream_options: { include_usage: true } }),
        credentials: "omit",
      });
      if (!response.ok) {
        const body = await response.json().catch(() => ({}));
        throw new Error(`${response.status}: ${(body.error && body.error.message) || response.statusText}`);
      }
      for await (const data of sseData(response)) {
        if (data === "[DONE]") break;
        let chunk;
        try {
          chunk = JSON.parse(data);
        } catch {
          continue;
        }
        if (chunk.usage) usage = chunk.usage;
        const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
        if (delta && delta.content) {
          if (first === null) first = performance.now();
          chunks += 1;
          text += delta.content;
          answer.textContent = text;
          log.scrollTop = log.scrollHeight;
        }
      }
      history.push({ role: "assistant", content: text });
      const ended = performance.now();
      const tokens = usage && usage.completion_tokens ? usage.completion_tokens : chunks;
      const ttft = first === null ? null : first - started;
      const rate = first !== null && ended > first ? tokens / ((ended - first) / 1000) : null;
      stats.textContent = `Time to first token: ${ttft === null ? "—" : fmtNumber(ttft) + " ms"} · tokens/s: ${rate === null ? "—" : fmtNumber(rate, 1)} · ${tokens} tokens`;
    } catch (e) {
      history.pop();
      error.replaceChildren(errorBox(e));
    } finally {
      answer.parentElement.classList.remove("streaming");
      answer.parentElement.classList.add("done");
      send.disabled = false;
    }
  }

  select.addEventListener("change", showKey);
  main.append(
    el("h1", { text: "Playground" }),
    el(
      "section",
      { class: "card" },
      el(
        "div",
        { class: "row" },
        el("label", { for: "deployment", text: "Deployment" }),
        select,
      ),
      el(
        "div",
        { class: "row" },
        el("label", { for: "api-key", text: "API key" }),
        keyInput,
        el("button", { type: "button", class: "ghost", id: "create-key", onclick: createKey, text: "Create playground key" }),
        el("button", { type: "button", class: "ghost danger", onclick: revokeKey, text: "Revoke" }),
      ),
      keyNote,
    ),
    el("section", { class: "card" }, log, el("form", { class: "chat-form", onsubmit: chat }, prompt, send), stats, error),
  );
  Promise.all([api("GET", "/deployments"), api("GET", "/replicas")])
    .then(([deps, replicas]) => {
      if (!deps.length) {
        log.replaceChildren(empty("No deployment to chat with yet."));
        return;
      }
      const serving = new Set(replicas.filter((r) => r.state === "Running").map((r) => r.deployment));
      // Deployments with a Running replica first: those answer at once.
      const ordered = [...deps].sort((a, b) => Number(serving.has(b.name)) - Number(serving.has(a.name)));
      select.replaceChildren(
        ...ordered.map((d) => el("option", { value: d.name, text: serving.has(d.name) ? d.name : `${d.name} (no replica running)` })),
      );
      showKey();
    })
    .catch((e) => error.replaceChildren(errorBox(e)));
}
