// Keys: the gateway's API keys: create (the secret shown once), revoke, models and limits, and
// each key's usage (from GET /api/v1/usage, when the server has it).

import { POLL_MS, ApiError, api, badge, el, empty, errorBox, every, fmtNumber, fmtTime, section, table } from "./core.js";

function usageSince(hours) {
  return new Date(Date.now() - hours * 3600 * 1000).toISOString();
}

// Usage per key id over the last day; null when the server has no usage endpoint.
async function usageByKey() {
  try {
    const usage = await api("GET", `/usage?since=${encodeURIComponent(usageSince(24))}&step=hour`);
    return new Map(((usage.totals || {}).keys || []).map((k) => [k.keyId, k]));
  } catch (e) {
    if (e instanceof ApiError && e.status === 404) return null;
    throw e;
  }
}

export function render(main, status) {
  const name = el("input", { id: "key-name", name: "name", required: true, maxlength: "63", pattern: "[A-Za-z0-9][A-Za-z0-9._\\-]*", placeholder: "team-a" });
  const models = el("input", { id: "key-models", name: "models", required: true, maxlength: "2000", value: "*", placeholder: "* or model, model" });
  const rpm = el("input", { id: "key-rpm", name: "rpm", type: "number", min: "1", placeholder: "unlimited" });
  const tpm = el("input", { id: "key-tpm", name: "tpm", type: "number", min: "1", placeholder: "unlimited" });
  const created = el("div", { id: "created-key" });
  const error = el("div", {});
  const list = el("div", {});
  let refresh = () => {};

  async function create(event) {
    event.preventDefault();
    error.replaceChildren();
    const body = {
      name: name.value.trim(),
      models: models.value.split(",").map((m) => m.trim()).filter(Boolean),
    };
    if (rpm.value) body.rpm = Number(rpm.value);
    if (tpm.value) body.tpm = Number(tpm.value);
    try {
      const key = await api("POST", "/keys", body);
      const secret = el("code", { class: "secret", id: "new-key-secret", text: key.key });
      created.replaceChildren(
        el(
          "div",
          { class: "notice", role: "status" },
          el("p", {}, el("strong", { text: `Key ${key.name} created.` }), " Copy it now: it is shown this once and stored only as a hash."),
          secret,
          el(
            "button",
            {
              type: "button",
              class: "ghost",
              onclick: async (e) => {
                try {
                  await navigator.clipboard.writeText(key.key);
                  e.target.textContent = "Copied";
                } catch {
                  e.target.textContent = "Select and copy by hand";
                }
              },
              text: "Copy",
            },
          ),
          el("button", { type: "button", class: "ghost", onclick: () => created.replaceChildren(), text: "Done" }),
        ),
      );
      name.value = "";
      refresh();
    } catch (e) {
      error.replaceChildren(errorBox(e));
    }
  }

  async function revoke(key) {
    if (!window.confirm(`Revoke key ${key.name}? Clients using it are refused from now on.`)) return;
    try {
      await api("DELETE", `/keys/${key.id}`);
    } catch (e) {
      error.replaceChildren(errorBox(e));
    }
    refresh();
  }

  main.append(
    el("h1", { text: "Keys" }),
    section(
      "Create a key",
      el(
        "form",
        { class: "form-grid", id: "create-key-form", onsubmit: create },
        el("label", { for: "key-name", text: "Name" }),
        name,
        el("label", { for: "key-models", text: "Models (comma-separated, * for all)" }),
        models,
        el("label", { for: "key-rpm", text: "Requests per minute" }),
        rpm,
        el("label", { for: "key-tpm", text: "Tokens per minute" }),
        tpm,
        el("button", { type: "submit", id: "create-key", text: "Create key" }),
      ),
      created,
      error,
    ),
    section("Keys", list),
  );
  refresh = every(
    POLL_MS,
    async () => {
      const [keys, usage] = await Promise.all([api("GET", "/keys"), usageByKey()]);
      if (!keys.length) {
        list.replaceChildren(empty("No API key yet."));
        return;
      }
      const rows = keys
        .slice()
        .reverse()
        .map((k) => {
          const u = usage ? usage.get(k.id) : null;
          return [
            String(k.id),
            k.name,
            k.models.join(", "),
            k.rpm ? `${fmtNumber(k.rpm)} rpm` : "—",
            k.tpm ? `${fmtNumber(k.tpm)} tpm` : "—",
            usage === null ? "no data" : u ? `${fmtNumber(u.requests)} req, ${fmtNumber(u.promptTokens + u.completionTokens)} tok` : "0",
            fmtTime(k.createdAt),
            k.revoked ? badge("revoked") : badge("active", "good"),
            k.revoked ? "" : el("button", { type: "button", class: "ghost danger", "data-key": k.name, onclick: () => revoke(k), text: "Revoke" }),
          ];
        });
      list.replaceChildren(
        table(["Id", "Name", "Models", "Rate", "Tokens", "Usage (24 h)", "Created", "State", ""], rows, { id: "keys" }),
        usage === null ? el("p", { class: "muted", text: "Usage: no data (this server has no usage records)." }) : null,
      );
    },
    status,
  );
}
