// Calls to the server's APIs with the keys held in memory; errors carry the API's own message.

export class ApiError extends Error {
  constructor(status, message, body) {
    super(message);
    this.status = status;
    this.body = body;
  }
  // "401 Token authorization failed: ..." as the console shows it.
  get display() { return `${this.status} ${this.message}`; }
}

// The message of an error body: TorchServe's {code, type, message}, OpenAI's {error: {message}}.
export function errorMessage(body, fallback) {
  if (body && typeof body === "object") {
    if (typeof body.message === "string") return body.message;
    if (body.error && typeof body.error.message === "string") return body.error.message;
    if (typeof body.error === "string") return body.error;
  }
  return fallback;
}

export class Api {
  constructor(token, inferenceToken, inferenceUrl = "") {
    this.token = token;
    this.inferenceToken = inferenceToken;
    this.inferenceUrl = inferenceUrl;
  }

  headers(token) {
    return token ? { Authorization: `Bearer ${token}` } : {};
  }

  // A management call: path relative to this origin; resolves to JSON (or text), throws ApiError.
  async management(method, path, query) {
    const url = new URL(path, location.origin);
    for (const [k, v] of Object.entries(query || {})) {
      if (v !== undefined && v !== null && v !== "") url.searchParams.set(k, String(v));
    }
    const resp = await fetch(url, { method, headers: this.headers(this.token), cache: "no-store" });
    return readReply(resp);
  }

  get(path, query) { return this.management("GET", path, query); }

  // An inference call (another origin: the inference port); returns the raw Response.
  async inference(path, body, signal) {
    const resp = await fetch(this.inferenceUrl + path, {
      method: "POST", signal, cache: "no-store",
      headers: { ...this.headers(this.inferenceToken), "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    if (!resp.ok) await readReply(resp);  // throws with the API's message
    return resp;
  }
}

async function readReply(resp) {
  const type = resp.headers.get("Content-Type") || "";
  const text = await resp.text();
  let body = text;
  if (type.includes("json")) {
    try { body = JSON.parse(text); } catch { body = text; }
  }
  if (!resp.ok) {
    throw new ApiError(resp.status, errorMessage(body, text.trim() || resp.statusText), body);
  }
  return body;
}
