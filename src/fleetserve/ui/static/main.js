// The dashboard's entry point: draws the page its path names, marks it in the navigation, and
// wires the logout button. Every page module exports render(main, status).

import { CSRF_HEADER, csrfToken, el, errorBox } from "./core.js";
import * as deployments from "./deployments.js";
import * as events from "./events.js";
import * as fleet from "./fleet.js";
import * as keys from "./keys.js";
import * as playground from "./playground.js";
import * as replica from "./replica.js";
import * as usage from "./usage.js";

const PAGES = { fleet, deployments, replica, playground, keys, usage, events };
const TITLES = {
  fleet: "Fleet",
  deployments: "Deployments",
  replica: "Replica",
  playground: "Playground",
  keys: "Keys",
  usage: "Usage",
  events: "Events",
};

async function logout() {
  try {
    await fetch("/ui/logout", { method: "POST", headers: { [CSRF_HEADER]: csrfToken() }, credentials: "same-origin" });
  } finally {
    window.location.assign("/ui/login");
  }
}

function start() {
  const name = window.location.pathname.replace(/^\/ui\/?/, "").split("/")[0] || "fleet";
  const main = document.getElementById("main");
  const status = document.getElementById("live");
  document.getElementById("logout").addEventListener("click", logout);
  for (const a of document.querySelectorAll("#nav a")) {
    if (a.dataset.page === name) a.setAttribute("aria-current", "page");
  }
  const page = PAGES[name];
  if (!page) {
    document.title = "Not found — fleetserve";
    main.replaceChildren(el("h1", { text: "Not found" }), el("p", { text: `There is no page ${name}.` }));
    return;
  }
  document.title = `${TITLES[name]} — fleetserve`;
  main.replaceChildren();
  try {
    page.render(main, status);
  } catch (error) {
    main.replaceChildren(errorBox(error));
  }
}

start();
