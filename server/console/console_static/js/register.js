// Register a model (or a LoRA adapter) from the model store or an allowed URL: POST /models.

import { $, h, report } from "./dom.js";

export class Register {
  constructor(app) {
    this.app = app;
    $("register-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      this.submit();
    });
    $("reg-archive").addEventListener("change", () => {
      if ($("reg-archive").value) $("reg-url").value = $("reg-archive").value;
    });
  }

  setInfo(info) {
    const select = $("reg-archive");
    select.replaceChildren(h("option", { value: "", text: "— or type a URL below —" }),
      ...info.storeArchives.map((name) => h("option", { value: name, text: name })));
    $("model-api-off").hidden = info.modelApi;
    $("allowed-urls").textContent = info.allowedUrls.length ? info.allowedUrls.join(", ") : "the model store only";
  }

  async submit() {
    const out = $("register-result");
    const url = $("reg-url").value.trim();
    const query = { url, model_name: $("reg-name").value.trim(), initial_workers: $("reg-workers").value,
      synchronous: "true" };
    report(out, true, `Registering ${url || "(no URL)"}…`);
    try {
      const reply = await this.app.api.management("POST", "/models", query);
      report(out, true, reply.status || "registered");
    } catch (e) {
      report(out, false, `Refused: ${e.display || e.message}`);
    }
    this.app.refresh();
  }
}
