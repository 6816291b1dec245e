// The Prometheus text format the server already exposes, read in the browser: samples by
// name, sums over label sets, and quantiles of histogram buckets (as PromQL's
// histogram_quantile computes them).

const LINE = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
const LABEL = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?/g;

export function parse(text) {
  const samples = new Map();  // name -> [{labels, value}]
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = LINE.exec(line);
    if (!m) continue;
    const labels = {};
    if (m[2]) {
      for (const l of m[2].matchAll(LABEL)) {
        labels[l[1]] = l[2].replace(/\\n/g, "\n").replace(/\\(.)/g, "$1");
      }
    }
    const value = m[3] === "+Inf" ? Infinity : m[3] === "-Inf" ? -Infinity : Number(m[3]);
    if (!samples.has(m[1])) samples.set(m[1], []);
    samples.get(m[1]).push({ labels, value });
  }
  return samples;
}

const matches = (labels, filter) => Object.entries(filter || {}).every(
  ([k, v]) => (typeof v === "function" ? v(labels[k]) : labels[k] === v));

// The sum of a family's samples whose labels match `filter` (a value or a predicate per label).
export function sum(samples, name, filter) {
  let total = 0;
  for (const s of samples.get(name) || []) if (matches(s.labels, filter)) total += s.value;
  return total;
}

export function select(samples, name, filter) {
  return (samples.get(name) || []).filter((s) => matches(s.labels, filter));
}

// Cumulative bucket counts of a histogram, summed over matching label sets: [[le, count]].
export function buckets(samples, name, filter) {
  const byLe = new Map();
  for (const s of select(samples, `${name}_bucket`, filter)) {
    const le = s.labels.le === "+Inf" ? Infinity : Number(s.labels.le);
    byLe.set(le, (byLe.get(le) || 0) + s.value);
  }
  return [...byLe.entries()].sort((a, b) => a[0] - b[0]);
}

// The bucket counts observed between two scrapes (a counter reset counts from zero).
export function bucketDelta(now, before) {
  const prev = new Map(before || []);
  return now.map(([le, c]) => {
    const p = prev.get(le) || 0;
    return [le, c >= p ? c - p : c];
  });
}

// The q-quantile of cumulative buckets, linearly interpolated inside its bucket; null if empty.
export function quantile(q, cumulative) {
  if (!cumulative.length) return null;
  const total = cumulative[cumulative.length - 1][1];
  if (!(total > 0)) return null;
  const rank = q * total;
  let prevLe = 0;
  let prevCount = 0;
  for (const [le, count] of cumulative) {
    if (count >= rank) {
      if (le === Infinity) return prevLe;
      if (count === prevCount) return le;
      return prevLe + ((le - prevLe) * (rank - prevCount)) / (count - prevCount);
    }
    prevLe = le;
    prevCount = count;
  }
  return prevLe;
}
