// The playground: a chat or completion request to any model or adapter, streamed token by token
// from the inference port (with the inference key), its timings as the browser measured them,
// and the same request as curl and as OpenAI SDK code.

import { $, h } from "./dom.js";
import { ApiError, errorMessage } from "./api.js";

export class Playground {
  constructor(app) {
    this.app = app;
    this.abort = null;
    $("play-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      this.send();
    });
    $("play-stop-btn").addEventListener("click", () => this.abort?.abort());
  }

  setKey(key) { $("play-key").value = key || ""; }

  setModels(snap) {
    const select = $("play-model");
    const names = [...snap.models.map((m) => m.name), ...snap.adapters.map((a) => a.modelName)];
    const current = [...select.options].map((o) => o.value);
    if (names.join("\n") === current.join("\n")) return;
    const chosen = select.value;
    select.replaceChildren(...names.map((n) => h("option", { value: n, text: n })));
    if (names.includes(chosen)) select.value = chosen;
  }

  mode() { return document.querySelector("input[name=play-mode]:checked").value; }

  // The request body from the form; a field left empty is left out (the server's default).
  body() {
    const num = (id) => ($(id).value.trim() === "" ? undefined : Number($(id).value));
    const chat = this.mode() === "chat";
    const prompt = $("play-prompt").value;
    const body = { model: $("play-model").value, stream: true, stream_options: { include_usage: true } };
    if (chat) {
      const system = $("play-system").value.trim();
      body.messages = [...(system ? [{ role: "system", content: system }] : []), { role: "user", content: prompt }];
    } else {
      body.prompt = prompt;
    }
    Object.assign(body, { max_tokens: num("play-max-tokens"), temperature: num("play-temperature"),
      top_p: num("play-top-p"), seed: num("play-seed") });
    if (num("play-top-k")) body.top_k = num("play-top-k");
    if ($("play-stop").value) body.stop = [$("play-stop").value];
    const schema = $("play-schema").value.trim();
    if (schema) {
      let parsed;
      try { parsed = JSON.parse(schema); } catch (e) { throw new Error(`JSON schema: not valid JSON (${e.message})`); }
      body.response_format = { type: "json_schema", json_schema: { name: "playground", schema: parsed } };
    }
    for (const k of Object.keys(body)) if (body[k] === undefined) delete body[k];
    return body;
  }

  async send() {
    const error = $("play-error");
    const output = $("play-output");
    error.textContent = "";
    let body;
    try { body = this.body(); } catch (e) { error.textContent = e.message; return; }
    if (!body.model) { error.textContent = "No model to send to."; return; }
    const chat = this.mode() === "chat";
    const path = chat ? "/v1/chat/completions" : "/v1/completions";
    this.snippets(path, body);
    output.textContent = "";
    this.app.api.inferenceToken = $("play-key").value.trim();
    this.abort = new AbortController();
    $("play-send").disabled = true;
    $("play-stop-btn").disabled = false;
    const t0 = performance.now();
    const times = [];
    let usage = null;
    let finish = null;
    try {
      const resp = await this.app.api.inference(path, body, this.abort.signal);
      await readEvents(resp, (event) => {
        if (event.error) throw new ApiError(event.error.code || 500, errorMessage(event, "stream error"), event);
        if (event.usage) usage = event.usage;
        for (const choice of event.choices || []) {
          const text = chat ? choice.delta?.content : choice.text;
          if (text) {
            times.push(performance.now());
            output.append(text);
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      });
    } catch (e) {
      if (e.name !== "AbortError") error.textContent = `Refused: ${e.display || e.message}`;
      else finish = "stopped";
    } finally {
      $("play-send").disabled = false;
      $("play-stop-btn").disabled = true;
      this.abort = null;
    }
    this.timings(t0, times, usage, finish);
  }

  timings(t0, times, usage, finish) {
    const end = performance.now();
    const gaps = times.slice(1).map((t, i) => t - times[i]);
    const tokens = usage?.completion_tokens ?? times.length;
    const fmt = (x, unit) => (Number.isFinite(x) ? `${x.toFixed(x < 10 ? 1 : 0)} ${unit}` : "–");
    const rows = [
      ["Time to first token", fmt(times.length ? times[0] - t0 : NaN, "ms")],
      ["Mean inter-token", fmt(gaps.length ? gaps.reduce((a, b) => a + b, 0) / gaps.length : NaN, "ms")],
      ["Total", fmt(end - t0, "ms")],
      ["Prompt tokens", usage ? String(usage.prompt_tokens) : "–"],
      ["Output tokens", String(tokens)],
      ["Tokens / s", fmt(times.length > 1 ? (1000 * (tokens - 1)) / (times.at(-1) - times[0]) : NaN, "")],
      ["Finish", finish || "–"],
    ];
    $("play-timings").replaceChildren(...rows.map(([k, v]) => h("div", {}, h("dt", { text: k }), h("dd", { text: v }))));
  }

  // The request just sent, as curl and as OpenAI SDK code (the key as a variable, not its value).
  snippets(path, body) {
    const base = this.app.api.inferenceUrl;
    const json = JSON.stringify(body, null, 2);
    $("play-curl").value = `curl -N ${base}${path} \\\n  -H "Authorization: Bearer $PAGEDSERVE_INFERENCE_KEY" \\\n`
      + `  -H "Content-Type: application/json" \\\n  -d '${json.replace(/'/g, "'\\''")}'`;
    const { model, stream, stream_options: _, messages, prompt, ...rest } = body;
    const extra = {};
    for (const k of ["top_k"]) if (k in rest) { extra[k] = rest[k]; delete rest[k]; }
    const py = (v) => JSON.stringify(v, null, 4).replace(/\btrue\b/g, "True").replace(/\bfalse\b/g, "False").replace(/\bnull\b/g, "None");
    const args = [`    model=${py(model)},`, messages ? `    messages=${py(messages)},` : `    prompt=${py(prompt)},`,
      ...Object.entries(rest).map(([k, v]) => `    ${k}=${py(v)},`),
      ...(Object.keys(extra).length ? [`    extra_body=${py(extra)},`] : []), `    stream=${stream ? "True" : "False"},`];
    const call = messages ? "client.chat.completions.create" : "client.completions.create";
    const read = messages ? "chunk.choices[0].delta.content or \"\"" : "chunk.choices[0].text";
    $("play-sdk").value = [
      "import os", "from openai import OpenAI", "",
      `client = OpenAI(base_url="${base}/v1", api_key=os.environ["PAGEDSERVE_INFERENCE_KEY"])`,
      `for chunk in ${call}(`, ...args, "):", "    if chunk.choices:", `        print(${read}, end="", flush=True)`,
    ].join("\n");
  }
}

// Server-sent events of a streamed reply: each `data:` line's JSON, until `[DONE]`.
async function readEvents(resp, onEvent) {
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, cut).trim();
      buffer = buffer.slice(cut + 1);
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      onEvent(JSON.parse(data));
    }
  }
}
