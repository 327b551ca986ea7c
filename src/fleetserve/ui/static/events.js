// Events: the audit log of admin actions (GET /api/v1/events): who, what, when.

import { POLL_MS, ApiError, api, el, empty, every, fmtTime, table } from "./core.js";

const LIMIT = 200;

export function render(main, status) {
  const action = el("input", { id: "action", placeholder: "any action", maxlength: "63", autocomplete: "off" });
  const body = el("div", { id: "events" });
  let refresh = () => {};
  action.addEventListener("change", () => refresh());
  main.append(el("h1", { text: "Events" }), el("div", { class: "row" }, el("label", { for: "action", text: "Action" }), action), body);
  refresh = every(
    POLL_MS,
    async () => {
      const params = new URLSearchParams({ limit: String(LIMIT) });
      if (action.value.trim()) params.set("action", action.value.trim());
      let events;
      try {
        events = await api("GET", `/events?${params}`);
      } catch (e) {
        if (e instanceof ApiError && e.status === 404) {
          body.replaceChildren(empty("No data: this server keeps no audit log."));
          return;
        }
        throw e;
      }
      if (!events.length) {
        body.replaceChildren(empty("No admin action recorded yet."));
        return;
      }
      const rows = events.map((e) => [
        fmtTime(e.at),
        e.actor,
        e.action,
        e.target,
        Object.keys(e.detail || {}).length ? JSON.stringify(e.detail) : "",
        e.source || "",
      ]);
      body.replaceChildren(table(["When", "Who", "Action", "Target", "Detail", "From"], rows, { id: "events-table" }));
    },
    status,
  );
}
