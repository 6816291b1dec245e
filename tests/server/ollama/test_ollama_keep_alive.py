"""Ollama's keep_alive through the real `ollama` client, on an in-process server over the tiny
model registered with minWorkers 0 (loaded on demand): a request loads it and `ps` lists it with
its expiry; `keep_alive=0` unloads it right after (gone from `ps`); an empty generate with no
keep_alive loads it; with `keep_alive=-1` it stays (expiry "never")."""

from __future__ import annotations

import pytest

from tests.server.conftest import TINY

ollama = pytest.importorskip("ollama")

CONFIG = """\
minWorkers: 0
maxWorkers: 1
startupTimeout: 300
keepAlive: 300
handler:
  dtype: float32
  max_model_len: 256
  kv_cache_memory: 8MiB
"""


@pytest.fixture(scope="module")
def srv(inprocess_factory, tiny_model, tmp_path_factory):
    from pagedserve.engine.model.archive import write_archive

    store = tmp_path_factory.mktemp("ollama_store")
    config = tmp_path_factory.mktemp("ollama-config") / "model-config.yaml"
    config.write_text(CONFIG)
    write_archive(tiny_model, store, model_name=TINY, version="1.0", config_file=config)
    server = inprocess_factory(model_store=str(store), enable_model_api=True)
    r = server.post("management", f"/models?url={TINY}.mar&initial_workers=0&synchronous=true")
    assert r.status == 200, r.text
    return server


@pytest.fixture(scope="module")
def client(srv):
    return ollama.Client(host=srv.url("inference"), headers={"Authorization": f"Bearer {srv.keys['inference']}"})


def _loaded(client) -> list:
    return [m for m in client.ps().models if m.model == f"{TINY}:1.0"]


def test_keep_alive_zero_unloads_and_ps_shows_it(client, srv):
    assert _loaded(client) == []  # registered, not loaded
    r = client.generate(model=TINY, prompt="hello", raw=True, options={"num_predict": 3})
    assert r.eval_count == 3 and r.load_duration > 0  # this request loaded the model
    [entry] = _loaded(client)
    assert entry.size > 0 and entry.context_length == 256 and entry.expires_at.year > 2000
    again = client.generate(model=TINY, prompt="hello", raw=True, options={"num_predict": 3})
    assert again.load_duration == 0
    client.chat(model=TINY, messages=[{"role": "user", "content": "hi"}], options={"num_predict": 2}, keep_alive=0)
    srv.wait_for(lambda: not _loaded(client), timeout=30, what="unloaded after keep_alive=0")


def test_empty_generate_loads_and_keep_alive_minus_one_keeps_it(client, srv):
    r = client.generate(model=TINY, keep_alive=-1)
    assert r.done and r.done_reason == "load" and r.response == ""
    [entry] = _loaded(client)
    assert entry.expires_at.year == 1  # never, as Ollama writes it
    r = client.generate(model=TINY, keep_alive=0)
    assert r.done_reason == "unload"
    srv.wait_for(lambda: not _loaded(client), timeout=30, what="unloaded by an empty generate")
