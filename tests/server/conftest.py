"""Fixtures for server tests: a model store holding an archive of the default model (made once
per session), and real `pagedserve serve` processes on free ports (see server_process.py)."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pagedserve.server.common.config import ServerConfig
from tests.server.inprocess import InProcessServer
from tests.server.server_process import ServerProcess

MODEL = "smollm2"
ARCHIVE = "smollm2.mar"
ARCHIVE_V2 = "smollm2-v2.mar"
# Small and fast for a shared 2-core machine: bf16, a 64 MiB KV pool (182 blocks of 16 tokens).
TINY = "tiny"
TINY_ARCHIVE = "tiny.mar"
TINY_ARCHIVE_V2 = "tiny-v2.mar"
TINY_MODEL_CONFIG = """\
minWorkers: 1
maxWorkers: 2
startupTimeout: 300
handler:
  dtype: float32
  max_model_len: 256
  kv_cache_memory: 8MiB
"""
TEST_MODEL_CONFIG = """\
minWorkers: 1
maxWorkers: 4
responseTimeout: 120
startupTimeout: 300
handler:
  dtype: bfloat16
  max_model_len: 2048
  kv_cache_memory: 64MiB
"""


def _test_cache() -> Path:
    """Archives of the default model built for tests, and their extractions: in the user cache,
    built once per machine (not once per xdist worker in the temp folder: 540 MB each)."""
    from pagedserve.engine.model.default_model import default_cache_dir

    return default_cache_dir() / "tests"


def _write_archive(store: Path, tmp: Path, file_name: str, version: str) -> Path:
    """`store/file_name`: a hard link to the default model's archive of `version` in the test
    cache (built there once, under a lock that parallel workers share)."""
    import fcntl
    import hashlib
    import os

    from pagedserve.engine.model.archive import write_archive
    from pagedserve.engine.model.default_model import default_gguf_path, default_model_dir

    try:
        default_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    model_dir = default_model_dir()
    key = hashlib.sha256(f"{model_dir.name}|{version}|{TEST_MODEL_CONFIG}".encode()).hexdigest()[:12]
    cache = _test_cache() / "archives" / key
    cache.mkdir(parents=True, exist_ok=True)
    cached = cache / file_name
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not cached.exists():
            config = tmp / f"model-config-{version}.yaml"
            config.write_text(TEST_MODEL_CONFIG)
            written = write_archive(
                model_dir, cache / f"build-{version}", model_name=MODEL, version=version, config_file=config
            )
            written.rename(cached)
            (cache / f"build-{version}").rmdir()
    dest = store / file_name
    try:
        os.link(cached, dest)  # same file: no bytes in the temp folder, one extraction
    except OSError:  # another file system
        shutil.copy2(cached, dest)
    return dest


@pytest.fixture(scope="session")
def model_store(tmp_path_factory) -> Path:
    """A model store with `smollm2.mar` (version 1.0 of the default model)."""
    store = tmp_path_factory.mktemp("model_store")
    _write_archive(store, tmp_path_factory.mktemp("archive-build"), ARCHIVE, "1.0")
    return store


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random-weight Llama with the default model's tokenizer: workers start in seconds."""
    transformers = pytest.importorskip("transformers")

    from pagedserve.engine.model.default_model import default_model_dir

    model = tmp_path_factory.mktemp("tiny") / "model"
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=49152,
        max_position_embeddings=512,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(model, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model_dir() / name, model / name)
    return model


@pytest.fixture(scope="session")
def archive_v2(model_store, tmp_path_factory) -> str:
    """`smollm2-v2.mar` in the same store: version 2.0 of model smollm2 (same weights)."""
    if not (model_store / ARCHIVE_V2).exists():
        _write_archive(model_store, tmp_path_factory.mktemp("archive-build-v2"), ARCHIVE_V2, "2.0")
    return ARCHIVE_V2


@pytest.fixture(scope="session")
def archive_cache() -> Path:
    """Where servers extract archives: in the test cache, shared by the session's servers and
    by parallel workers (extraction is keyed by the archive file and locked: the default
    model's archive, hard-linked into each store, is extracted once per machine). Extractions
    not used for 6 hours (those of the small archives a session builds for itself) are removed
    when a session starts."""
    cache = _test_cache() / "extracted"
    cache.mkdir(parents=True, exist_ok=True)
    _prune_extractions(cache, max_age_s=6 * 3600)
    return cache


def _prune_extractions(cache: Path, max_age_s: float) -> None:
    import fcntl
    import time

    for lock_path in cache.glob(".*.lock"):  # opened (mtime updated) on every use
        try:
            if time.time() - lock_path.stat().st_mtime < max_age_s:
                continue
            with open(lock_path, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(cache / lock_path.name[1:].removesuffix(".lock"), ignore_errors=True)
                lock_path.unlink()
        except OSError:  # in use by another worker, or gone already
            continue


ServerFactory = Callable[..., ServerProcess]


def _factory(tmp_path_factory, model_store: Path, archive_cache: Path, servers: list[ServerProcess]) -> ServerFactory:
    def make(
        *,
        models: list[str] | None = None,
        args: list[str] | None = None,
        env: dict | None = None,
        config: dict | None = None,
        start: bool = True,
        ready: bool = True,
        workdir: Path | None = None,
        key_file: str = "key_file.json",
    ) -> ServerProcess:
        server = ServerProcess(
            workdir=workdir or tmp_path_factory.mktemp("server"),
            model_store=model_store,
            models=list(models or []),
            args=list(args or []),
            env={"PAGEDSERVE_ARCHIVE_DIR": str(archive_cache), **(env or {})},
            config=config,
            key_file=key_file,
        )
        servers.append(server)
        return server.start(ready=ready) if start else server

    return make


@pytest.fixture
def server_factory(tmp_path_factory, model_store, archive_cache) -> Iterator[ServerFactory]:
    """`server_factory(models=[...], args=[...], env={...}, config={...})` -> a started
    ServerProcess; every one is stopped at the end of the test."""
    servers: list[ServerProcess] = []
    yield _factory(tmp_path_factory, model_store, archive_cache, servers)
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def module_server_factory(tmp_path_factory, model_store, archive_cache) -> Iterator[ServerFactory]:
    """Like server_factory, for servers shared by a whole test module."""
    servers: list[ServerProcess] = []
    yield _factory(tmp_path_factory, model_store, archive_cache, servers)
    for s in servers:
        s.stop()


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory, model_store, archive_cache) -> Iterator[ServerProcess]:
    """One real server for the whole session (one per xdist worker): smollm2 (1 worker)
    registered at start, token auth on. Only for modules that leave it as they found it: no
    scaling, registering, draining or signals (those start their own with module_server_factory),
    and no assertion that a prompt of 16+ tokens is not yet in the prefix cache unless the prompt
    is the module's own."""
    servers: list[ServerProcess] = []
    yield _factory(tmp_path_factory, model_store, archive_cache, servers)(models=[f"{MODEL}={ARCHIVE}"])
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def server(shared_server) -> ServerProcess:
    """The session's shared real server (see `shared_server`), alive at the module's start."""
    shared_server.check_alive()
    return shared_server


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory, tiny_model) -> Path:
    """A model store with `tiny.mar`: the tiny random-weight model as model "tiny" 1.0."""
    from pagedserve.engine.model.archive import write_archive

    store = tmp_path_factory.mktemp("tiny_store")
    config = tmp_path_factory.mktemp("tiny-config") / "model-config.yaml"
    config.write_text(TINY_MODEL_CONFIG)
    write_archive(tiny_model, store, model_name=TINY, version="1.0", config_file=config)
    v2 = write_archive(
        tiny_model, tmp_path_factory.mktemp("tiny-v2"), model_name=TINY, version="2.0", config_file=config
    )
    v2.rename(store / TINY_ARCHIVE_V2)  # version 2.0 of "tiny" (same weights)
    return store


InProcessFactory = Callable[..., InProcessServer]


@pytest.fixture(scope="module")
def inprocess_factory(tmp_path_factory, tiny_store, archive_cache) -> Iterator[InProcessFactory]:
    """`inprocess_factory(**config)` -> a started in-process server over `tiny_store` (workers
    are real engine processes on the tiny model; one thread each; no snapshot unless asked);
    every one is stopped at the end of the module. The workers take the engine's plain torch
    path (PAGEDSERVE_DISABLE_CPU_KERNELS): the C++ kernels are not what these tests are about,
    and loading them costs each worker seconds on a busy machine."""
    servers: list[InProcessServer] = []
    mp = pytest.MonkeyPatch()
    mp.setenv("PAGEDSERVE_ARCHIVE_DIR", str(archive_cache))
    mp.setenv("PAGEDSERVE_DISABLE_CPU_KERNELS", "1")

    def make(*, ready: bool = True, **settings) -> InProcessServer:
        workdir = tmp_path_factory.mktemp("inprocess")
        defaults = {
            "model_store": str(tiny_store),
            "worker_threads": 1,
            "snapshot_path": None,
            "key_file": str(workdir / "key_file.json"),
            **{f"{api}_address": "127.0.0.1:0" for api in ("inference", "management", "metrics")},
        }
        server = InProcessServer(ServerConfig(**{**defaults, **settings}))
        servers.append(server)
        return server.start(ready=ready)

    yield make
    for server in servers:
        server.stop()
    mp.undo()


@pytest.fixture(scope="module")
def tiny_server(inprocess_factory) -> InProcessServer:
    """One in-process server per module: "tiny" (1 worker) registered at start, token auth on."""
    return inprocess_factory(load_models=[f"{TINY}={TINY_ARCHIVE}"])
