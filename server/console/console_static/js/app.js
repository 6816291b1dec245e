// The console's entry: sign-in (the management key, kept in this page's memory only), the tabs,
// and one polling loop over the existing management endpoints that feeds every page.

import { Api } from "./api.js";
import { $ } from "./dom.js";
import { Overview } from "./overview.js";
import { Charts } from "./charts.js";
import { Register } from "./register.js";
import { Playground } from "./playground.js";
import { parse } from "./prom.js";

const POLL_MS = 2000;
const TABS = ["overview", "charts", "register", "playground"];

class Console {
  constructor() {
    this.api = null;
    this.timer = null;
    this.generation = 0;  // bumped at sign-out: a poll in flight then drops its result
    this.overview = new Overview(this);
    this.charts = new Charts();
    this.register = new Register(this);
    this.playground = new Playground(this);
  }

  start() {
    $("signin-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      this.signIn($("signin-token").value.trim(), $("signin-inference").value.trim());
    });
    $("sign-out").addEventListener("click", () => this.signOut(""));
    this.setupTabs();
    window.addEventListener("hashchange", () => this.fromFragment());  // a link opened in this tab
    if (!this.fromFragment()) $("signin-token").focus();
  }

  // The sign-in link carries the keys in the fragment (never sent to the server); take them
  // and drop the fragment from the address bar and the history at once.
  fromFragment() {
    const params = new URLSearchParams(location.hash.slice(1));
    if (location.hash) history.replaceState(null, "", location.pathname);
    if (!params.get("token")) return false;
    this.signIn(params.get("token"), params.get("inference_token") || "");
    return true;
  }

  async signIn(token, inferenceToken) {
    const error = $("signin-error");
    error.textContent = "";
    if (!token) {
      error.textContent = "Enter the management key.";
      return;
    }
    const api = new Api(token, inferenceToken);
    let info;
    try {
      await api.get("/models", { limit: 1 });
      info = await api.get("/console/api/info");
    } catch (e) {
      error.textContent = `Refused: ${e.display || e.message}`;
      return;
    }
    api.inferenceUrl = info.inferenceUrl;
    this.api = api;
    this.info = info;
    $("signin-token").value = "";
    $("signin-inference").value = "";
    $("signin").hidden = true;
    $("tabs").hidden = false;
    $("session").hidden = false;
    this.register.setInfo(info);
    this.playground.setKey(inferenceToken);
    this.show("overview");
    await this.refresh();
  }

  signOut(message) {
    this.generation++;
    clearTimeout(this.timer);
    this.api = null;
    this.playground.setKey("");
    for (const id of ["tabs", "session", ...TABS]) $(id).hidden = true;
    $("signin").hidden = false;
    $("signin-error").textContent = message;
    $("signin-token").focus();
  }

  // -- tabs: arrow keys move between them (WAI-ARIA tabs pattern) --------------------------
  setupTabs() {
    TABS.forEach((name, i) => {
      const tab = $(`tab-${name}`);
      tab.addEventListener("click", () => this.show(name));
      tab.addEventListener("keydown", (ev) => {
        const step = { ArrowRight: 1, ArrowLeft: -1 }[ev.key];
        if (ev.key === "Home" || ev.key === "End" || step) {
          ev.preventDefault();
          const next = ev.key === "Home" ? 0 : ev.key === "End" ? TABS.length - 1
            : (i + step + TABS.length) % TABS.length;
          this.show(TABS[next]);
          $(`tab-${TABS[next]}`).focus();
        }
      });
    });
  }

  show(name) {
    for (const other of TABS) {
      const selected = other === name;
      $(other).hidden = !selected;
      const tab = $(`tab-${other}`);
      tab.setAttribute("aria-selected", String(selected));
      tab.tabIndex = selected ? 0 : -1;
    }
    if (name === "charts") this.charts.shown();
  }

  // -- the polling loop ---------------------------------------------------------------------
  async refresh() {
    clearTimeout(this.timer);
    const generation = this.generation;
    try {
      const snapshot = await this.fetchSnapshot();
      if (generation !== this.generation) return;
      this.overview.render(snapshot);
      this.charts.add(snapshot);
      this.playground.setModels(snapshot);
      const live = $("live");
      live.textContent = `live · ${new Date(snapshot.time).toLocaleTimeString()}`;
      live.classList.remove("stale");
    } catch (e) {
      if (generation !== this.generation) return;
      if (e.status === 401) {
        this.signOut(`Signed out: the management key was refused (${e.message})`);
        return;
      }
      $("live").textContent = `not updating: ${e.display || e.message}`;
      $("live").classList.add("stale");
    }
    if (generation === this.generation) this.timer = setTimeout(() => this.refresh(), POLL_MS);
  }

  // Every model's versions (GET /models, GET /models/{m}/all), the adapters, and the metrics.
  async fetchSnapshot() {
    const api = this.api;
    const listed = [];
    let token = "0";
    for (;;) {
      const page = await api.get("/models", { limit: 100, next_page_token: token });
      listed.push(...page.models);
      if (!page.nextPageToken) break;
      token = page.nextPageToken;
    }
    const adapters = listed.filter((m) => m.parent);
    const names = listed.filter((m) => !m.parent).map((m) => m.modelName);
    const [versions, metricsText, history] = await Promise.all([
      Promise.all(names.map((n) => api.get(`/models/${encodeURIComponent(n)}/all`).catch((e) => {
        if (e.status === 404) return [];  // unregistered between the two calls
        throw e;
      }))),
      api.get("/console/api/metrics"),
      api.get("/console/api/history", { since: this.charts.since }),
    ]);
    return {
      time: Date.now(),
      models: names.map((name, i) => ({ name, versions: versions[i] })),
      adapters,
      metrics: parse(metricsText),
      history: history.samples,
    };
  }
}

window.addEventListener("DOMContentLoaded", () => new Console().start());
