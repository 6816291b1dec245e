// The overview: the memory budget, then a card per model version (state, workers and their
// devices, memory against the budget, KV blocks, prefix-cache hit rate, adapters) with its
// actions (scale, set default, sleep / wake, unload; remove an adapter). Every figure comes from
// the management API's descriptions and the server's metrics; nothing is kept here.

import { $, bar, bytes, h, percent, report } from "./dom.js";
import { sum } from "./prom.js";

// The state to show: the lifecycle's, or "crash-looping" when no worker is up and they keep dying.
export function versionState(v) {
  const workers = v.workers || [];
  const ready = workers.some((w) => w.status === "READY");
  const dying = workers.some((w) => w.restarts > 0 && w.lastError && w.status !== "READY");
  return !ready && dying ? "crash-looping" : v.state || "unloaded";
}

export function versionMemory(v) {
  return (v.workers || []).reduce((acc, w) => acc + Math.max(w.footprint?.total || 0, w.memoryUsage || 0), 0);
}

export class Overview {
  constructor(app) {
    this.app = app;
    this.cards = new Map();  // "model/version" -> {card, body, actions}
  }

  render(snap) {
    const m = snap.metrics;
    const budget = sum(m, "pagedserve_memory_budget_bytes");
    const used = sum(m, "pagedserve_memory_budget_used_bytes");
    $("budget").replaceChildren(
      h("div", { class: "label" }, h("strong", { text: "Memory budget" }),
        h("span", { text: `${bytes(used)} used of ${bytes(budget)}` })),
      bar(used, budget, "Memory used by all workers against the budget"));

    const seen = new Set();
    const container = $("models");
    for (const model of snap.models) {
      for (const v of model.versions) {
        const key = `${v.modelName}/${v.modelVersion}`;
        seen.add(key);
        let entry = this.cards.get(key);
        if (!entry) {
          entry = this.buildCard(v);
          this.cards.set(key, entry);
          container.append(entry.card);
        }
        const adapters = snap.adapters.filter((a) => a.parent === v.modelName);
        this.fill(entry, v, adapters, m, budget);
      }
    }
    for (const [key, entry] of this.cards) {
      if (!seen.has(key)) {
        entry.card.remove();
        this.cards.delete(key);
      }
    }
    if (!this.cards.size && !container.querySelector(".empty")) {
      container.append(h("p", { class: "empty hint", text: "No model is registered. Register one on the Register page." }));
    } else if (this.cards.size) {
      container.querySelector(".empty")?.remove();
    }
  }

  // A card's fixed part (title, actions) is built once, so focus and typed values survive polls.
  buildCard(v) {
    const name = v.modelName;
    const version = v.modelVersion;
    const id = `${name}-${version}`.replace(/[^A-Za-z0-9_-]/g, "_");
    const path = `/models/${encodeURIComponent(name)}/${encodeURIComponent(version)}`;
    const title = h("h3", {}, h("span", { text: `${name} ${version}` }));
    const state = h("span", { class: "badge" });
    const isDefault = h("span", { class: "badge default", text: "default" });
    title.append(state, isDefault);
    const body = h("div");
    const workersInput = h("input", { id: `scale-${id}`, type: "number", min: 0, max: 64, value: v.minWorkers,
      oninput: (ev) => { ev.currentTarget.dataset.edited = "1"; } });  // polls then leave it alone
    const act = (label, run, cls) => h("button", { type: "button", class: cls, onclick: (ev) => run(ev.currentTarget) }, label);
    const actions = h("div", { class: "actions", role: "group", "aria-label": `Actions on ${name} ${version}` },
      h("label", { for: `scale-${id}`, text: "Workers" }), workersInput,
      act("Scale", () => this.call(`Scale ${name} ${version}`, "PUT", path,
        this.scaleQuery(workersInput, this.cards.get(`${name}/${version}`).v))),
      act("Set default", () => this.call(`Set default ${name} ${version}`, "PUT", `${path}/set-default`)),
      act("Sleep", () => this.call(`Sleep ${name} ${version}`, "PUT", `${path}/sleep`)),
      act("Wake", () => this.call(`Wake ${name} ${version}`, "PUT", `${path}/wake`)),
      act("Unload", (btn) => this.confirmThen(btn, "Confirm unload",
        () => this.call(`Unload ${name} ${version}`, "DELETE", path)), "danger"));
    const card = h("article", { class: "card", "data-model": name, "data-version": version,
      "aria-label": `${name} ${version}` }, title, body, actions);
    return { card, body, state, isDefault, workersInput, v };
  }

  scaleQuery(input, v) {
    const n = Number(input.value);
    const query = { min_worker: input.value, synchronous: "true" };
    if (Number.isInteger(n) && n > v.maxWorkers) query.max_worker = n;  // raise the ceiling too
    return query;
  }

  fill(entry, v, adapters, m, budget) {
    entry.v = v;
    const state = versionState(v);
    entry.state.textContent = state;
    entry.state.className = `badge ${state}`;
    entry.isDefault.hidden = !v.isDefault;
    if (document.activeElement !== entry.workersInput && !entry.workersInput.dataset.edited) {
      entry.workersInput.value = v.minWorkers;
    }
    const labels = { model: v.modelName, version: v.modelVersion };
    const kvUsed = sum(m, "pagedserve_kv_blocks_used", labels);
    const kvFree = sum(m, "pagedserve_kv_blocks_free", labels);
    const hitRate = sum(m, "pagedserve_prefix_cache_hit_rate", labels);
    const memory = versionMemory(v);
    const workers = v.workers || [];
    const ready = workers.filter((w) => w.status === "READY").length;
    const device = (w) => (w.gpu ? "cuda" : v.deviceType || "cpu");
    entry.body.replaceChildren(...[
      h("dl", { class: "facts" },
        h("dt", { text: "Workers" }),
        h("dd", { class: "workers-count", "data-count": workers.length,
          text: `${workers.length} (${ready} ready; min ${v.minWorkers}, max ${v.maxWorkers})` }),
        h("dt", { text: "Memory" }),
        h("dd", { class: "memory", text: `${bytes(memory)} of the ${bytes(budget)} budget` }),
        h("dt", { text: "KV blocks" }),
        h("dd", { text: kvUsed + kvFree ? `${kvUsed} in use of ${kvUsed + kvFree}` : "–" }),
        h("dt", { text: "Prefix-cache hits" }), h("dd", { text: percent(hitRate) }),
        h("dt", { text: "Queue" }),
        h("dd", { text: `${v.jobQueueStatus?.pendingRequests ?? 0} pending` }),
        v.pinned ? [h("dt", { text: "Pinned" }), h("dd", { text: "yes" })] : null),
      bar(memory, budget, `Memory of ${v.modelName} ${v.modelVersion} against the budget`),
      workers.length ? h("table", { class: "workers" },
        h("caption", { class: "visually-hidden", text: `Workers of ${v.modelName} ${v.modelVersion}` }),
        h("thead", {}, h("tr", {}, ["Worker", "Status", "Device", "PID", "Memory", "Restarts"].map(
          (t) => h("th", { scope: "col", text: t })))),
        h("tbody", {}, workers.map((w) => h("tr", { title: w.lastError || "" },
          h("td", { text: w.id }), h("td", { text: w.status }), h("td", { text: device(w) }),
          h("td", { text: w.pid > 0 ? w.pid : "–" }),
          h("td", { text: bytes(Math.max(w.footprint?.total || 0, w.memoryUsage || 0)) }),
          h("td", { text: w.restarts }))))) : null,
      adapters.length ? h("div", {}, h("strong", { text: "LoRA adapters" }),
        h("ul", { class: "adapters" }, adapters.map((a) => h("li", {}, `${a.modelName} `,
          h("button", { type: "button", class: "link", "aria-label": `Remove adapter ${a.modelName}`,
            onclick: (ev) => this.confirmThen(ev.currentTarget, "Confirm remove",
              () => this.call(`Remove adapter ${a.modelName}`, "DELETE", `/models/${encodeURIComponent(a.modelName)}`)) },
          "remove"))))) : null,
    ].filter(Boolean));
  }

  // Destructive buttons take a second press within 4 s.
  confirmThen(button, confirmLabel, run) {
    const disarm = () => {
      delete button.dataset.armed;
      button.textContent = button.dataset.label;
      if (button.dataset.aria) button.setAttribute("aria-label", button.dataset.aria);
    };
    if (button.dataset.armed) {
      disarm();
      run();
      return;
    }
    button.dataset.armed = "1";
    button.dataset.label = button.textContent;
    button.textContent = confirmLabel;
    const aria = button.getAttribute("aria-label");
    if (aria) {
      button.dataset.aria = aria;
      button.setAttribute("aria-label", `${confirmLabel}: ${aria}`);
    }
    setTimeout(() => { if (button.dataset.armed) disarm(); }, 4000);
  }

  async call(what, method, path, query) {
    const out = $("action-result");
    report(out, true, `${what}…`);
    try {
      const reply = await this.app.api.management(method, path, query);
      report(out, true, `${what}: ${reply.status || "done"}`);
      for (const entry of this.cards.values()) delete entry.workersInput.dataset.edited;
    } catch (e) {
      report(out, false, `${what} refused: ${e.display || e.message}`);
    }
    this.app.refresh();
  }
}
