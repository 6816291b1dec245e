// DOM helpers: elements are built with textContent only (never innerHTML), so nothing a model
// name or an error message holds can run as markup.

export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "text") el.textContent = value;
    else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

export const $ = (id) => document.getElementById(id);

export function bytes(n) {
  if (n === null || n === undefined || Number.isNaN(n)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i && n < 10 ? 1 : 0)} ${units[i]}`;
}

export function percent(x) {
  return Number.isFinite(x) ? `${(100 * x).toFixed(1)} %` : "–";
}

// A bar of `used` out of `total`, with its text for screen readers.
export function bar(used, total, label) {
  const frac = total > 0 ? Math.min(1, used / total) : 0;
  const fill = h("span");
  fill.style.width = `${(100 * frac).toFixed(1)}%`;
  const cls = frac >= 0.95 ? "bar full" : frac >= 0.8 ? "bar high" : "bar";
  return h("div", { class: cls, role: "meter", "aria-label": label, "aria-valuemin": 0,
    "aria-valuemax": total, "aria-valuenow": Math.round(used),
    "aria-valuetext": `${bytes(used)} of ${bytes(total)}` }, fill);
}

// Show an outcome in a status line: ok (the API's status) or the API's own error.
export function report(el, ok, text) {
  el.textContent = text;
  el.className = `result ${ok ? "ok" : "bad"}`;
  el.setAttribute("role", ok ? "status" : "alert");
}
