"""Fuzz of every route of the three ports of one real server (issue 11): no 5xx, no hang, no
worker death.

One `pagedserve serve` process (token auth on, `--enable-model-api`) serves `fuzz`, a tiny
random-weight Llama with the default model's tokenizer, plus `scaled` (the same weights,
registered by the suite) for the scale calls. Hypothesis draws the requests (strategies in
fuzz_values.py): JSON bodies built from the declared schemas' field names with hostile values,
odd methods, paths, content types and encodings, odd management parameters, and the metrics port.
It is derandomized (the same requests on every run), with no shrinking (a failure names the
exact request instead) and a bounded number of examples per test, to stay well under three
minutes on a busy 2-core machine.

Every reply must come within CLIENT_TIMEOUT_S (the connection is not dropped either) with a
status below 500. The one exception, 503 with `Retry-After`, is the server's documented answer
when a job queue is full, no worker is ready or it drains; requests here go one at a time to a
model whose worker is up, so it should not appear on the inference routes. After the run the
`fuzz` worker is still the same process and `/ping` is Healthy. What the suite never does: unregister
or scale `fuzz`, or ask for more than 2 workers; registration URLs outside the model store are
tried only to see them refused (403, nothing read).
"""

from __future__ import annotations

import http.client
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlencode

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.server import fuzz_values as fv
from tests.server.server_process import ServerProcess

CLIENT_TIMEOUT_S = 30.0  # per request ("no hang"); generous for a busy 2-core machine
MODEL, SCALED = "fuzz", "scaled"
CONFIG = """\
minWorkers: 1
maxWorkers: 2
responseTimeout: 60
handler:
  dtype: float32
  max_model_len: 256
  kv_cache_memory: 8MiB
"""
FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=list(HealthCheck),
    print_blob=False,
)


@dataclass(slots=True)
class Reply:
    status: int
    headers: http.client.HTTPMessage
    body: bytes


@pytest.fixture(scope="module")
def server(tiny_model, archive_cache, tmp_path_factory) -> Iterator[ServerProcess]:
    """The server, with a model store of its own: the tiny model as `fuzz.mar` (registered at
    start) and as `extra.mar` (registered by the fixture as `scaled`; both maxWorkers 2)."""
    from pagedserve.engine.model.archive import write_archive

    store, build = tmp_path_factory.mktemp("fuzz-store"), tmp_path_factory.mktemp("fuzz-build")
    (build / "model-config.yaml").write_text(CONFIG)
    for name in (MODEL, "extra"):
        write_archive(tiny_model, store, model_name=name, version="1.0", config_file=build / "model-config.yaml")
    srv = ServerProcess(
        tmp_path_factory.mktemp("fuzz-server"),
        store,
        models=[f"{MODEL}=fuzz.mar"],
        args=["--enable-model-api"],
        env={"PAGEDSERVE_ARCHIVE_DIR": str(archive_cache)},
    )
    try:
        srv.start()
        r = srv.post("management", f"/models?url=extra.mar&model_name={SCALED}&synchronous=true")
        assert r.status == 200, r.text
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def worker_pid(server) -> int:
    """The `fuzz` worker's pid before any fuzzing."""
    [worker] = server.get("management", f"/models/{MODEL}").json()[0]["workers"]
    assert worker["pid"] > 0
    return worker["pid"]


def send(
    server: ServerProcess,
    method: str,
    api: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    token: str | None = "right",
) -> Reply:
    """One request on a fresh connection, the head and the body written apart (as a client on
    a real network often does: a body that arrives after its headers once stalled the server,
    see tests/server/serving/test_content_encoding.py); the whole reply (a stream to its end) is read."""
    hdrs = {"Host": "127.0.0.1", "Connection": "close", **(headers or {})}
    if token == "right":
        hdrs.update(server.auth_headers(api))
    elif token is not None:
        hdrs["Authorization"] = token
    if body is not None:
        hdrs["Content-Length"] = str(len(body))
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
    what = f"{method} {api}:{path[:300]} headers={hdrs} body={(body or b'')[:600]!r}"
    sock = socket.create_connection(("127.0.0.1", server.ports[api]), timeout=CLIENT_TIMEOUT_S)
    try:
        sock.sendall(head.encode("latin-1") + b"\r\n")
        if body:
            sock.sendall(body)
        resp = http.client.HTTPResponse(sock, method=method)
        resp.begin()
        reply = Reply(resp.status, resp.headers, resp.read())
    except TimeoutError:
        pytest.fail(f"no reply within {CLIENT_TIMEOUT_S:.0f}s (hang): {what}\n{server.log_tail(40)}")
    except (ConnectionError, http.client.HTTPException) as exc:
        pytest.fail(f"connection failed ({type(exc).__name__}: {exc}): {what}\n{server.log_tail(40)}")
    finally:
        sock.close()
    check(reply, what, server)
    return reply


def check(reply: Reply, what: str, server: ServerProcess) -> None:
    ok = reply.status < 500 or (reply.status == 503 and reply.headers.get("Retry-After"))
    assert ok, f"{reply.status} {reply.body[:2000]!r}\nfor {what}\n{server.log_tail(40)}"
    for line in reply.body.splitlines():  # a stream that fails must not go on with a new status line
        assert not line.startswith(b"HTTP/1."), f"a status line inside the body of {what}"


def json_request(server: ServerProcess, method: str, api: str, path: str, value) -> Reply:
    return send(
        server, method, api, path, fv.dump(value).encode("utf-8", "surrogatepass"), {"Content-Type": "application/json"}
    )


# -- inference port --------------------------------------------------------------------------
ROUTES = [
    ("/predictions/fuzz", fv.PREDICTIONS, {"prompt": fv.PLAUSIBLE["prompt"]}),
    ("/predictions/fuzz/1.0", fv.PREDICTIONS, {"messages": fv.PLAUSIBLE["messages"]}),
    ("/v1/completions", fv.COMPLETIONS, {"model": fv.PLAUSIBLE["model"], "prompt": fv.PLAUSIBLE["prompt"]}),
    ("/v1/chat/completions", fv.CHAT, {"model": fv.PLAUSIBLE["model"], "messages": fv.PLAUSIBLE["messages"]}),
    ("/predictions/fuzz/1.0/v1/completions", fv.COMPLETIONS, {"prompt": fv.PLAUSIBLE["prompt"]}),
    ("/predictions/fuzz/1.0/v1/chat/completions", fv.CHAT, {"messages": fv.PLAUSIBLE["messages"]}),
    ("/api/generate", fv.OLLAMA_GENERATE, {"model": fv.PLAUSIBLE["model"], "prompt": fv.PLAUSIBLE["prompt"]}),
    ("/api/chat", fv.OLLAMA_CHAT, {"model": fv.PLAUSIBLE["model"], "messages": fv.PLAUSIBLE["messages"]}),
    ("/api/embed", fv.OLLAMA_EMBED, {"model": fv.PLAUSIBLE["model"], "input": fv.PLAUSIBLE["prompt"]}),
    ("/v1/messages", fv.ANTHROPIC, {"model": fv.PLAUSIBLE["model"], "messages": fv.PLAUSIBLE["messages"]}),
    ("/tokenize", fv.TOKENIZE, {"model": fv.PLAUSIBLE["model"], "prompt": fv.PLAUSIBLE["prompt"]}),
]


@st.composite
def inference_body(draw):
    path, fields, required = draw(st.sampled_from(ROUTES))
    return path, draw(fv.body(fields, required))


@settings(FUZZ, max_examples=220)
@given(request=inference_body())
def test_inference_bodies(server, worker_pid, request):
    """Bodies for /predictions and the OpenAI routes, every form of their paths."""
    path, body = request
    json_request(server, "POST", "inference", path, body)


INFERENCE_PATHS = [
    "/ping",
    "/live",
    "/ready",
    "/v1/models",
    "/predictions/fuzz/1.0/v1/models",
    "/predictions/{s}",
    "/predictions/fuzz/{s}",
    "/predictions/{s}/{s}/v1/completions",
    "/predictions/fuzz/{s}/v1/chat/completions",
    "/predictions/{s}/1.0/v1/models",
    "/v1/{s}",
    "/{s}",
    "/predictions/fuzz/1.0/{s}",
    "/v1/completions",
    "/predictions/fuzz",
    "/api/{s}",
    "/api/chat",
    "/api/tags",
    "/api/ps",
    "/v1/messages",
    "/v1/messages/{s}",
    "/tokenize",
    "/health",
]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "FUZZ"]
CONTENT_TYPES = [
    None,
    "application/json",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/json; charset=latin-1",
    "application/json; charset=utf-16",
    "application/octet-stream",
    "\u00ff/\u00ff",
]
ENCODINGS = [None, None, "gzip", "deflate", "br", "identity", "x-fuzz", "gzip, deflate"]
TOKENS = ["right"] * 6 + [None, "Bearer wrong", "Bearer ", "Basic Zm9vOmJhcg==", "Bearer " + "k" * 9000]


@st.composite
def raw_request(draw, paths):
    path = draw(st.sampled_from(paths))
    while "{s}" in path:
        path = path.replace("{s}", draw(fv.path_segment()), 1)
    if draw(st.integers(0, 4)) == 0:
        path += "?" + urlencode(
            draw(st.dictionaries(st.sampled_from(["limit", "x", "stream", ""]), st.text(max_size=10), max_size=3))
        )
    headers = {}
    ctype, encoding = draw(st.sampled_from(CONTENT_TYPES)), draw(st.sampled_from(ENCODINGS))
    if ctype:
        headers["Content-Type"] = ctype.encode("utf-8").decode("latin-1")
    if encoding:
        headers["Content-Encoding"] = encoding
    body = draw(st.one_of(fv.whole_body(), st.just(b'{"prompt": "1, 2,", "max_tokens": 2, "model": "fuzz"}')))
    return draw(st.sampled_from(METHODS)), path, body, headers, draw(st.sampled_from(TOKENS))


@settings(FUZZ, max_examples=150)
@given(request=raw_request(INFERENCE_PATHS))
def test_inference_raw(server, worker_pid, request):
    """Every inference route with odd methods, path segments, content types, encodings, tokens
    and bodies that are no JSON object."""
    method, path, body, headers, token = request
    send(server, method, "inference", path, None if method in ("GET", "HEAD") else body, headers, token)


# -- management port -------------------------------------------------------------------------
NAMES = [
    MODEL,
    SCALED,
    "nope",
    "",
    "a" * 129,
    "a" * 5000,
    "1abc",
    "a b",
    "../x",
    "a/b",
    "ÿ",
    "\ud800",
    "all",
    "models",
    "fuzz.1",
    "_x",
]
URLS = [
    "extra.mar",
    "extra.mar",
    "nope.mar",
    "../extra.mar",
    "x/../extra.mar",
    "/etc/passwd",
    "fuzz.mar",
    "file:///etc/passwd",
    "http://127.0.0.1:1/x.mar",
    "https://example.com/m.mar",
    "fuzz",
    ".",
    "",
    "extra.mar\x00",
    "x" * 5000,
    "extra.mar?x=1",
    "~/x.mar",
    "./extra.mar",
]
WORKERS = st.one_of(
    st.sampled_from([0, 1, 2, -1, 65, 2**31, 2**64, "1.5", "x", "", "1e1", "true", " 1"]), st.text(max_size=5)
)
SECONDS = st.sampled_from([-1, 0, 1, 5, 86_400, 86_401, 2**63, 10**30, "nan", "inf", "-inf", "1.5", "x", ""])
BOOLS = st.sampled_from(["true", "false", "TRUE", "1", "0", "yes", "", "x"])


def params(**fields) -> st.SearchStrategy:
    """Some of the call's parameters (and now and then an unknown one), as a query dict."""
    fields["bogus"] = st.text(max_size=5)
    return st.fixed_dictionaries({}, optional=fields)


REGISTER = params(
    url=st.sampled_from(URLS),
    model_name=st.sampled_from(["reg", "Reg-2.x", *NAMES]),
    initial_workers=WORKERS,
    synchronous=BOOLS,
    response_timeout=SECONDS,
    batch_size=st.sampled_from([1, 2, 0, "x"]),
    max_batch_delay=SECONDS,
    runtime=st.sampled_from(["python", "", "x" * 300]),
)
SCALE = params(min_worker=WORKERS, max_worker=WORKERS, synchronous=BOOLS, timeout=SECONDS, number_gpu=WORKERS)


def query(path: str, values: dict) -> str:
    text = urlencode({k: str(v).encode("utf-8", "surrogatepass") for k, v in values.items()})
    return f"{path}?{text}" if text else path


def segment(name: str) -> str:
    return fv.quote(name.encode("utf-8", "surrogatepass"), safe="")


def register(server: ServerProcess, values: dict, as_json: bool) -> None:
    if as_json:
        r = json_request(server, "POST", "management", "/models", values)
    else:
        r = send(server, "POST", "management", query("/models", values))
    if r.status in (200, 202):  # registered: take it away again
        name = values.get("model_name") or "extra"
        assert name not in (MODEL, SCALED), f"registered over {name}: {values}"
        assert send(server, "DELETE", "management", f"/models/{segment(name)}").status == 200


@st.composite
def management_call(draw):
    kind = draw(
        st.sampled_from(["list", "describe", "register", "register_json", "scale", "set_default", "unregister", "raw"])
    )
    name, version = draw(st.sampled_from(NAMES)), draw(st.sampled_from(["1.0", "2.0", "all", "", "\ud800", "x" * 300]))
    if kind == "list":
        values = draw(params(limit=WORKERS | SECONDS, next_page_token=WORKERS | SECONDS))
        return lambda s: send(s, "GET", "management", query("/models", values))
    if kind == "describe":
        path = f"/models/{segment(name)}" + draw(st.sampled_from(["", f"/{segment(version)}"]))
        return lambda s: send(s, "GET", "management", path)
    if kind in ("register", "register_json"):
        values = draw(REGISTER)
        return lambda s: register(s, values, kind == "register_json")
    if kind == "scale":  # never the model under test; at most 2 workers are ever asked for
        target = draw(st.sampled_from([SCALED, f"{SCALED}/1.0", f"{SCALED}/9.9", "nope", "nope/1.0"]))
        values = draw(SCALE)
        return lambda s: send(s, "PUT", "management", query(f"/models/{target}", values))
    if kind == "set_default":
        path = f"/models/{segment(name)}/{segment(version)}/set-default"
        return lambda s: send(s, "PUT", "management", path)
    if kind == "unregister":  # unknown names and versions only
        target = draw(
            st.sampled_from([n for n in NAMES if n not in (MODEL, SCALED)] + [f"{SCALED}/9.9", f"{MODEL}/2.0"])
        )
        values = draw(params(synchronous=BOOLS, timeout=SECONDS))
        path = query("/models/" + "/".join(segment(p) for p in target.split("/")), values)
        return lambda s: send(s, "DELETE", "management", path)
    method = draw(st.sampled_from(["PATCH", "OPTIONS", "HEAD", "FUZZ", "POST", "GET"]))
    path = draw(
        st.sampled_from(["/", "/models/", "/models/fuzz/1.0/set-default", "/models/fuzz/1.0/x/y", f"/{segment(name)}"])
    )
    body, token = draw(fv.whole_body()), draw(st.sampled_from(TOKENS))
    return lambda s: send(
        s,
        method,
        "management",
        path,
        None if method in ("GET", "HEAD") else body,
        {"Content-Type": "application/json"},
        token,
    )


@settings(FUZZ, max_examples=150)
@given(call=management_call())
def test_management(server, worker_pid, call):
    """Register (archives inside the store, odd parameters), list, describe, scale `scaled`,
    set-default, unregister unknown names, and odd methods."""
    call(server)


# -- metrics port ----------------------------------------------------------------------------
@settings(FUZZ, max_examples=40)
@given(request=raw_request(["/metrics", "/metrics/{s}", "/{s}", "/metrics"]))
def test_metrics(server, request):
    method, path, body, headers, _ = request
    r = send(server, method, "metrics", path, None if method in ("GET", "HEAD") else body, headers, None)
    if method == "GET" and path == "/metrics":
        assert r.status == 200 and b"pagedserve_requests_total" in r.body


# -- after the run ---------------------------------------------------------------------------
def test_no_worker_died(server, worker_pid):
    """Run last: the `fuzz` worker is the same process, it still answers, and /ping is Healthy.
    The fuzz reached the engine too (generations answered 200), not only the first refusals."""
    from prometheus_client.parser import text_string_to_metric_families

    metrics = text_string_to_metric_families(server.get("metrics", "/metrics").text)
    generated = sum(
        s.value
        for fam in metrics
        if fam.name == "pagedserve_requests"
        for s in fam.samples
        if s.name.endswith("_total")
        and s.labels["status"] == "200"
        and s.labels["endpoint"] in ("predictions", "completions", "chat_completions")
    )
    assert generated >= 20, generated
    [worker] = server.get("management", f"/models/{MODEL}").json()[0]["workers"]
    assert worker["pid"] == worker_pid and worker["restarts"] == 0, worker
    r = server.predict(MODEL, max_tokens=2)
    assert r.status == 200, r.text
    assert server.delete("management", f"/models/{SCALED}").status == 200
    ping = server.get("inference", "/ping")
    assert (ping.status, ping.json()) == (200, {"status": "Healthy"}), server.log_tail()
