// Live charts of the last 15 minutes, drawn with uPlot (vendored, pinned: vendor/VERSIONS.md)
// from the server's own metrics, sampled every 2 s by the server (GET /console/api/history,
// read incrementally at each poll): output tokens/s, requests/s, the queue, TTFT and ITL
// p50 / p99, preemptions; for all models or one.

import { $, h } from "./dom.js";
import { bucketDelta, buckets, parse, quantile, sum } from "./prom.js";

const WINDOW_S = 15 * 60;
const QUANTILE_WINDOW_S = 30;  // percentiles over the requests of the last 30 s

const CHARTS = [
  { id: "tokens", title: "Output tokens / s", series: [["tokens/s", "#2456c7"]] },
  { id: "requests", title: "Requests / s", series: [["req/s", "#1d7f3b"]] },
  { id: "queue", title: "Queue (requests)", series: [["waiting", "#a35c00"], ["running", "#2456c7"]] },
  { id: "ttft", title: "Time to first token (ms)", series: [["p50", "#2456c7"], ["p99", "#b3261e"]] },
  { id: "itl", title: "Inter-token latency (ms)", series: [["p50", "#2456c7"], ["p99", "#b3261e"]] },
  { id: "preemptions", title: "Preemptions / s", series: [["preemptions/s", "#5b2a9a"]] },
];

// The cumulative figures of one scrape for one model (model "" = all models).
function figures(m, model) {
  const f = model ? { model } : {};
  return {
    gen: sum(m, "pagedserve_generation_tokens_total", f),
    req: sum(m, "pagedserve_requests_total", { ...f, endpoint: (e) => e !== "management" }),
    waiting: sum(m, "pagedserve_num_requests_waiting", f),
    running: sum(m, "pagedserve_num_requests_running", f),
    pre: sum(m, "pagedserve_preemptions_total", f),
    ttft: buckets(m, "pagedserve_time_to_first_token_seconds", f),
    itl: buckets(m, "pagedserve_inter_token_latency_seconds", f),
  };
}

const rate = (now, before, dt) => (dt > 0 && now >= before ? (now - before) / dt : null);
const ms = (s) => (s === null ? null : 1000 * s);

export class Charts {
  constructor() {
    this.samples = [];  // {t (s), metrics}
    this.models = new Set();
    this.plots = new Map();
    this.select = $("chart-model");
    this.select.addEventListener("change", () => this.draw());
  }

  // The time of the newest sample held: the next poll asks for what came after it.
  get since() { return this.samples.length ? this.samples.at(-1).t : 0; }

  add(snap) {
    for (const s of snap.history) {
      if (s.t > this.since) this.samples.push({ t: s.t, metrics: parse(s.metrics) });
    }
    const t = this.since;
    while (this.samples.length && this.samples[0].t < t - WINDOW_S) this.samples.shift();
    for (const model of snap.models) {
      if (!this.models.has(model.name)) {
        this.models.add(model.name);
        this.select.append(h("option", { value: model.name, text: model.name }));
      }
    }
    if (!$("charts").hidden) this.draw();
  }

  shown() {
    if (!this.plots.size) this.build();
    this.draw();
  }

  build() {
    const grid = $("chart-grid");
    for (const spec of CHARTS) {
      const target = h("div");
      const fig = h("figure", { class: "chart", id: `chart-${spec.id}`, "aria-label": spec.title },
        h("figcaption", { text: spec.title }), target);
      grid.append(fig);
      const plot = new window.uPlot({
        width: Math.max(300, target.clientWidth || 400), height: 180,
        scales: { x: { time: true } },
        series: [{}, ...spec.series.map(([label, stroke]) => ({ label, stroke, width: 2, spanGaps: false }))],
        axes: [{}, { size: 50 }],
        legend: { live: false },
      }, [[], ...spec.series.map(() => [])], target);
      this.plots.set(spec.id, { plot, fig, target });
    }
    new ResizeObserver(() => {
      for (const { plot, target } of this.plots.values()) {
        if (target.clientWidth) plot.setSize({ width: target.clientWidth, height: 180 });
      }
    }).observe(grid);
  }

  // The series of the chosen model, derived from consecutive scrapes.
  series() {
    const model = this.select.value;
    const figs = this.samples.map((s) => ({ t: s.t, ...figures(s.metrics, model) }));
    const out = { x: [], tokens: [[]], requests: [[]], queue: [[], []], ttft: [[], []], itl: [[], []], preemptions: [[]] };
    let back = 0;  // the first sample inside the percentile window
    for (let i = 1; i < figs.length; i++) {
      const now = figs[i];
      const prev = figs[i - 1];
      const dt = now.t - prev.t;
      while (figs[back].t < now.t - QUANTILE_WINDOW_S) back++;
      const base = figs[Math.min(back, i - 1)];
      const ttft = bucketDelta(now.ttft, base.ttft);
      const itl = bucketDelta(now.itl, base.itl);
      out.x.push(now.t);
      out.tokens[0].push(rate(now.gen, prev.gen, dt));
      out.requests[0].push(rate(now.req, prev.req, dt));
      out.queue[0].push(now.waiting);
      out.queue[1].push(now.running);
      out.ttft[0].push(ms(quantile(0.5, ttft)));
      out.ttft[1].push(ms(quantile(0.99, ttft)));
      out.itl[0].push(ms(quantile(0.5, itl)));
      out.itl[1].push(ms(quantile(0.99, itl)));
      out.preemptions[0].push(rate(now.pre, prev.pre, dt));
    }
    return out;
  }

  draw() {
    if (!this.plots.size) return;
    const data = this.series();
    for (const [id, { plot, fig }] of this.plots) {
      plot.setData([data.x, ...data[id]]);
      // What the chart holds, for people using a screen reader (and for the browser tests).
      const values = data[id].flat().filter((v) => Number.isFinite(v));
      fig.dataset.points = String(values.length);
      fig.dataset.first = String(data.x[0] ?? "");
      fig.dataset.max = String(values.length ? Math.max(...values) : 0);
      fig.setAttribute("aria-description",
        values.length ? `${values.length} points, latest ${values.at(-1).toFixed(2)}, max ${fig.dataset.max}` : "no data yet");
    }
  }
}
