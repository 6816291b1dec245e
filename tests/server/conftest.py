"""Fixtures for server tests: a model store holding an archive of the default model (made once
per session), and real `pagedserve serve` processes on free ports (see server_process.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from server.config import ServerConfig
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


def _write_archive(store: Path, tmp: Path, file_name: str, version: str) -> Path:
    from engine.model.archive import write_archive
    from engine.model.default_model import default_gguf_path, default_model_dir

    try:
        default_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    config = tmp / f"model-config-{version}.yaml"
    config.write_text(TEST_MODEL_CONFIG)
    written = write_archive(default_model_dir(), tmp / f"build-{version}", model_name=MODEL,
                            version=version, config_file=config)
    dest = store / file_name
    written.rename(dest)
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
    import shutil

    from engine.model.default_model import default_model_dir

    model = tmp_path_factory.mktemp("tiny") / "model"
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2,
                                      vocab_size=49152, max_position_embeddings=512)
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
def archive_cache(tmp_path_factory) -> Path:
    """Where servers extract archives (shared by the session's servers: extracted once)."""
    return tmp_path_factory.mktemp("archive_cache")


ServerFactory = Callable[..., ServerProcess]


def _factory(tmp_path_factory, model_store: Path, archive_cache: Path,
             servers: list[ServerProcess]) -> ServerFactory:
    def make(*, models: list[str] | None = None, args: list[str] | None = None,
             env: dict | None = None, config: dict | None = None, start: bool = True,
             ready: bool = True, workdir: Path | None = None,
             key_file: str = "key_file.json") -> ServerProcess:
        server = ServerProcess(
            workdir=workdir or tmp_path_factory.mktemp("server"), model_store=model_store,
            models=list(models or []), args=list(args or []),
            env={"PAGEDSERVE_ARCHIVE_DIR": str(archive_cache), **(env or {})}, config=config,
            key_file=key_file)
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
    from engine.model.archive import write_archive

    store = tmp_path_factory.mktemp("tiny_store")
    config = tmp_path_factory.mktemp("tiny-config") / "model-config.yaml"
    config.write_text(TINY_MODEL_CONFIG)
    write_archive(tiny_model, store, model_name=TINY, version="1.0", config_file=config)
    v2 = write_archive(tiny_model, tmp_path_factory.mktemp("tiny-v2"), model_name=TINY,
                       version="2.0", config_file=config)
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
        defaults = {"model_store": str(tiny_store), "worker_threads": 1, "snapshot_path": None,
                    "key_file": str(workdir / "key_file.json"),
                    **{f"{api}_address": "127.0.0.1:0" for api in ("inference", "management", "metrics")}}
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
