"""Many model versions in one memory budget (pagedserve.server.workers.lifecycle): load on demand, LRU eviction,
keep-alive, pinning, sleep and wake, the snapshot of it all. One in-process server over tiny
random-weight archives (three versions of "lc" and one with a model-config keepAlive), real
worker processes; the budget is set from the first worker's measured footprint."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import pytest

from pagedserve.engine.platform.process_setup import resident_bytes

MODEL = "lc"
CONFIG = """\
minWorkers: 0
maxWorkers: 1
startupTimeout: 300
{extra}handler:
  dtype: float32
  max_model_len: 256
  kv_cache_memory: 8MiB
"""


@pytest.fixture(scope="module")
def lc_store(tmp_path_factory, tiny_model):
    from pagedserve.engine.model.archive import write_archive

    store = tmp_path_factory.mktemp("lc_store")
    for name, version, extra in (
        (MODEL, "1.0", ""),
        (MODEL, "2.0", ""),
        (MODEL, "3.0", ""),
        ("lcka", "1.0", "keepAlive: 1\n"),
    ):
        config = tmp_path_factory.mktemp("lc-config") / "model-config.yaml"
        config.write_text(CONFIG.format(extra=extra))
        built = write_archive(
            tiny_model, tmp_path_factory.mktemp("lc-build"), model_name=name, version=version, config_file=config
        )
        built.rename(store / f"{name}-{version}.mar")
    return store


@pytest.fixture(scope="module")
def srv(inprocess_factory, lc_store, tmp_path_factory):
    snapshot = tmp_path_factory.mktemp("lc-snapshot") / "snapshot.json"
    server = inprocess_factory(
        model_store=str(lc_store), enable_model_api=True, memory_budget="8GiB", snapshot_path=str(snapshot)
    )
    for name, version in ((MODEL, "1.0"), (MODEL, "2.0"), (MODEL, "3.0"), ("lcka", "1.0")):
        r = server.post("management", f"/models?url={name}-{version}.mar&initial_workers=0&synchronous=true")
        assert r.status == 200, r.text
    return server


def describe(srv, version: str, model: str = MODEL) -> dict:
    r = srv.get("management", f"/models/{model}/{version}")
    assert r.status == 200, r.text
    return r.json()[0]


def entry(srv, version: str, model: str = MODEL):
    return srv.state.registry.resolve(model, version)


def unload(srv, *versions: str) -> None:
    lifecycle = srv.state.registry.lifecycle
    for v in versions:
        srv.call(lifecycle.unload(entry(srv, v), "test reset"))


def reset(srv) -> None:
    """Every version unpinned and unloaded, the budget large: each test starts from here."""
    lifecycle = srv.state.registry.lifecycle
    lifecycle.budget.total = 8 << 30
    for model, version in ((MODEL, "1.0"), (MODEL, "2.0"), (MODEL, "3.0"), ("lcka", "1.0")):
        assert srv.put("management", f"/models/{model}/{version}/unpin").status == 200
        if entry(srv, version, model).pool.slots:
            srv.call(lifecycle.unload(entry(srv, version, model), "test reset"))
    lifecycle.evictions.clear()


def predict(srv, version: str, model: str = MODEL, **fields) -> dict:
    body = {"prompt": "1, 2, 3, 4,", "max_tokens": 4, "temperature": 0, **fields}
    r = srv.post("inference", f"/predictions/{model}/{version}", json=body)
    assert r.status == 200, r.text
    return r.json()


class RssSampler:
    """The sum of every worker's RSS, sampled every 100 ms on a thread of its own."""

    def __init__(self, srv) -> None:
        self.srv = srv
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            pids = [
                s.engine.pid
                for v in list(self.srv.state.registry.all_versions())
                for s in list(v.pool.slots)
                if s.engine is not None and s.engine.pid
            ]
            self.peak = max(self.peak, sum(resident_bytes(p) for p in pids))
            self.samples += 1
            self._stop.wait(0.1)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


def test_three_versions_in_a_budget_of_two_lru_pinning_and_requests_in_flight(srv):
    reset(srv)
    assert describe(srv, "1.0")["state"] == "unloaded"
    predict(srv, "1.0")  # loaded on demand: the request waited for the worker, no 503
    desc = describe(srv, "1.0")
    assert desc["state"] == "loaded"
    footprint = desc["workers"][0]["footprint"]
    assert footprint["overheadMeasured"] and footprint["weights"] > 0 and footprint["kvPool"] > 0
    lifecycle = srv.state.registry.lifecycle
    budget = lifecycle.budget.total = int(footprint["total"] * 2.5)  # two workers, not three
    with RssSampler(srv) as sampler:
        for version in ["2.0", "3.0", "1.0"]:  # round-robin: each later load evicts the LRU
            predict(srv, version)
        assert [v for _, v, _ in lifecycle.evictions] == ["1.0", "2.0"]
        # 3.0 is now the least recently used; pinned, it stays and 1.0 goes instead.
        assert srv.put("management", f"/models/{MODEL}/3.0/pin").status == 200
        predict(srv, "2.0")
        assert [v for _, v, _ in lifecycle.evictions] == ["1.0", "2.0", "1.0"]
        predict(srv, "3.0", keep_alive=0)  # keep-alive does not unload a pinned version either
        desc = describe(srv, "3.0")
        assert (desc["state"], desc["pinned"], desc["expiresAt"]) == ("loaded", True, None)
    assert sampler.samples > 5
    assert sampler.peak <= budget, (sampler.peak, budget)
    gauges = {
        line.split()[0]: float(line.split()[1])
        for line in srv.get("metrics", "/metrics").text.splitlines()
        if line.startswith("pagedserve_memory_budget")
    }
    assert gauges["pagedserve_memory_budget_bytes"] == budget
    assert gauges["pagedserve_memory_budget_used_bytes"] >= 2 * footprint["weights"]
    assert gauges["pagedserve_memory_budget_free_bytes"] == (budget - gauges["pagedserve_memory_budget_used_bytes"])
    # A request in flight on 2.0 (held open here) keeps it from being evicted: a load of 1.0
    # that cannot fit otherwise gets 503 with the reason, and nothing serving is disturbed.
    held = entry(srv, "2.0").admit()
    srv.call(_enter(held))
    try:
        lifecycle.budget.total = lifecycle.used() + footprint["total"] // 2
        r = srv.post("inference", f"/predictions/{MODEL}/1.0", json={"prompt": "hi", "max_tokens": 2})
        assert r.status == 503, r.text
        assert "no idle, unpinned version" in r.json()["message"] and "free" in r.json()["message"]
        assert describe(srv, "2.0")["state"] == "loaded"
    finally:
        srv.call(_exit(held))
    reset(srv)


async def _enter(cm) -> None:
    cm.__enter__()


async def _exit(cm) -> None:
    cm.__exit__(None, None, None)


def test_keep_alive_from_the_model_config_from_the_request_zero_and_forever(srv):
    reset(srv)
    predict(srv, "1.0", model="lcka")  # model-config keepAlive: 1
    desc = describe(srv, "1.0", model="lcka")
    assert desc["keepAlive"] == 1 and desc["expiresAt"] is not None
    predict(srv, "2.0", keep_alive=0)  # unloaded right after the request
    srv.wait_for(lambda: describe(srv, "2.0")["state"] == "unloaded", 60, what="unload")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # describe shows the load going on
        reply = pool.submit(predict, srv, "2.0", keep_alive="-1")
        seen: set[str] = set()

        def loading() -> bool:
            seen.add(describe(srv, "2.0")["state"])
            return "loading" in seen or reply.done()

        srv.wait_for(loading, 60, what="loading")
        out = reply.result(300)
    assert "loading" in seen, seen  # a worker start takes seconds: polled every 50 ms
    assert out["choices"][0]["token_ids"]
    desc = describe(srv, "2.0")
    assert desc["state"] == "loaded" and desc["expiresAt"] is None
    srv.wait_for(lambda: describe(srv, "1.0", model="lcka")["state"] == "unloaded", 60, what="keep-alive unload")
    assert describe(srv, "2.0")["state"] == "loaded"


def test_bad_keep_alive_is_a_400_naming_the_field(srv):
    r = srv.post("inference", f"/predictions/{MODEL}/2.0", json={"prompt": "hi", "max_tokens": 2, "keep_alive": "soon"})
    assert r.status == 400 and "keep_alive" in r.json()["message"]
    r = srv.post("inference", "/v1/completions", json={"model": f"{MODEL}@2.0", "prompt": "hi", "keep_alive": True})
    assert r.status == 400 and r.json()["error"]["param"] == "keep_alive"


def test_a_budget_smaller_than_one_model_refuses_the_registration(srv):
    lifecycle = srv.state.registry.lifecycle
    lifecycle.budget.total = 1 << 20
    try:
        r = srv.post("management", "/models?url=lc-3.0.mar&model_name=lcbig&initial_workers=0")
    finally:
        lifecycle.budget.total = 8 << 30
    assert r.status == 507, r.text
    message = r.json()["message"]
    assert "per worker" in message and "memory budget of 1.0 MiB" in message
    assert srv.get("management", "/models/lcbig").status == 404


def test_sleep_and_wake_round_trip(srv):
    srv.state.registry.lifecycle.budget.total = 8 << 30
    if entry(srv, "3.0").pool.slots:
        unload(srv, "3.0")  # the first request below is a cold load
    before = predict(srv, "3.0", max_tokens=8)["choices"][0]["token_ids"]  # a load on demand: a new worker
    worker = describe(srv, "3.0")["workers"][0]
    awake_rss, footprint = worker["memoryUsage"], worker["footprint"]
    assert srv.put("management", f"/models/{MODEL}/3.0/sleep").status == 200
    asleep = describe(srv, "3.0")
    assert asleep["state"] == "sleeping" and asleep["workers"][0]["status"] == "SLEEPING"
    assert asleep["workers"][0]["pid"] == worker["pid"]  # the process is kept
    drop = awake_rss - asleep["workers"][0]["memoryUsage"]
    assert drop >= 0.8 * (footprint["weights"] + footprint["kvPool"]), (drop, footprint)
    assert srv.put("management", f"/models/{MODEL}/3.0/wake").status == 200
    awake = describe(srv, "3.0")
    # Woken in place: the same process, no new load (a timing bar said this before; with workers
    # forked from a preloaded fork server a cold load of this tiny model is as quick as a wake).
    assert awake["state"] == "loaded" and awake["workers"][0]["pid"] == worker["pid"]
    after = predict(srv, "3.0", max_tokens=8)["choices"][0]["token_ids"]
    assert after == before
    # A request to a sleeping version wakes it.
    assert srv.put("management", f"/models/{MODEL}/3.0/sleep").status == 200
    assert predict(srv, "3.0", max_tokens=8)["choices"][0]["token_ids"] == before
    assert describe(srv, "3.0")["workers"][0]["pid"] == worker["pid"]


def test_the_lifecycle_api_needs_the_model_api(inprocess_factory, lc_store):
    server = inprocess_factory(model_store=str(lc_store), load_models=[f"{MODEL}=lc-1.0.mar"])
    r = server.put("management", f"/models/{MODEL}/1.0/sleep")
    assert r.status == 405 and "--enable-model-api" in r.json()["message"]
    assert server.put("management", f"/models/{MODEL}/1.0/sleep", token=None).status == 401


def test_the_snapshot_keeps_the_states_and_a_restart_restores_them(srv, inprocess_factory, lc_store, tmp_path):
    srv.state.registry.lifecycle.budget.total = 8 << 30
    for v in ("1.0", "2.0", "3.0"):
        assert srv.put("management", f"/models/{MODEL}/{v}/unpin").status == 200
    if entry(srv, "1.0").pool.slots:
        unload(srv, "1.0")
    assert srv.put("management", f"/models/{MODEL}/1.0/sleep").status == 409  # nothing loaded
    predict(srv, "2.0", keep_alive=-1)  # (loaded already when the earlier tests ran)
    predict(srv, "3.0", keep_alive=-1)
    assert srv.put("management", f"/models/{MODEL}/3.0/sleep").status == 200
    assert srv.put("management", f"/models/{MODEL}/1.0/pin").status == 200
    saved = {
        e["version"]: (e["state"], e["pinned"])
        for e in json.loads(open(srv.config.snapshot_path).read())["models"]
        if e["name"] == MODEL
    }
    expected = {"1.0": ("unloaded", True), "2.0": ("loaded", False), "3.0": ("sleeping", False)}
    assert saved == expected
    snapshot = tmp_path / "snapshot.json"
    snapshot.write_bytes(open(srv.config.snapshot_path, "rb").read())
    reset(srv)  # the second server's workers must fit beside what is left of this one
    again = inprocess_factory(
        model_store=str(lc_store), enable_model_api=True, memory_budget="8GiB", snapshot_path=str(snapshot)
    )
    again.wait_for(lambda: "pagedserve: ready" in again.log_text(), what="restore finished")
    states = {v: (describe(again, v)["state"], describe(again, v)["pinned"]) for v in expected}
    assert states == expected
    # Restored in parallel; a progress line per worker (2.0's, and 3.0's before it slept).
    progress = [line for line in again.lines if line.startswith("pagedserve: worker ")]
    assert len(progress) == 2 and all("ready in" in line for line in progress), again.log_tail()
    again.stop()
