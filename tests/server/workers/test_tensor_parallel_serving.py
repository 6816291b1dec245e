"""Tensor parallelism through the server, set by model-config.yaml's `parallelType: tp` and
`parallelLevel: N` (TorchServe's keys): one worker is N processes. Greedy output of the default
model at TP = 3 and of the tiny model at TP = 2 equals the same model at TP = 1 (offline, float32);
kill -9 of a rank mid-stream ends the stream with an error, the supervisor starts the group again
and the next request succeeds; registering a size the model cannot split is a 400 naming it.
In-process server; the real model only where the issue asks."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.model.archive import write_archive
from tests.server import observe

PROMPTS = ["1, 2, 3, 4,", "The capital of Germany is", "def fibonacci(n):"]
TP_CONFIG = """\
minWorkers: 1
maxWorkers: 1
startupTimeout: 300
parallelType: tp
parallelLevel: {level}
handler:
  dtype: float32
  max_model_len: 512
  kv_cache_memory: {kv}
"""


@pytest.fixture(scope="module")
def tp_store(tmp_path_factory, tiny_model, default_model_dir):
    """`tinytp.mar` (the tiny model, TP = 2), `smoltp` (the default model, TP = 3; a folder
    archive, verified in place: no extracted copy) and `three.mar` (a model of 3 heads, TP = 2:
    refused); removed at the end of the module."""
    transformers = pytest.importorskip("transformers")
    store = tmp_path_factory.mktemp("tp_store")
    build = tmp_path_factory.mktemp("tp_build")
    three = build / "three"
    transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=24,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=3,
            num_key_value_heads=3,
            vocab_size=64,
        )
    ).save_pretrained(three, safe_serialization=True)
    for name, model, level, kv, archive_format in (
        ("tinytp", tiny_model, 2, "8MiB", "default"),
        ("smoltp", default_model_dir, 3, "32MiB", "no-archive"),
        ("three", three, 2, "8MiB", "default"),
    ):
        config = build / f"{name}.yaml"
        config.write_text(TP_CONFIG.format(level=level, kv=kv))
        write_archive(model, store, model_name=name, version="1.0", config_file=config, archive_format=archive_format)
    yield store
    shutil.rmtree(store, ignore_errors=True)
    shutil.rmtree(build, ignore_errors=True)


@pytest.fixture(scope="module")
def server(inprocess_factory, tp_store):
    return inprocess_factory(
        model_store=str(tp_store), load_models=["tinytp=tinytp.mar", "smoltp=smoltp"], enable_model_api=True
    )


@pytest.fixture(scope="module")
def expected(tiny_model, default_model_dir, inprocess_factory):
    """Greedy token ids of each model at TP = 1, offline in this process (float32, the same
    torch path as the server's workers: inprocess_factory set PAGEDSERVE_DISABLE_CPU_KERNELS)."""
    threads = torch.get_num_threads()
    params = SamplingParams(max_tokens=8, temperature=0)
    out = {}
    for name, model in (("tinytp", tiny_model), ("smoltp", default_model_dir)):
        llm = LLM(model, dtype="float32", max_model_len=512, kv_cache_memory="32MiB", num_threads=1)
        out[name] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        del llm
    torch.set_num_threads(threads)
    return out


def rank_pids(worker_pid: int) -> list[int]:
    """The tensor-parallel ranks a worker spawned (its children started by multiprocessing's
    spawn; its resource tracker is not one)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == worker_pid and b"spawn_main" in cmdline:
            pids.append(int(entry.name))
    return sorted(pids)


def greedy(server, model: str) -> list[list[int]]:
    ids = []
    for prompt in PROMPTS:
        r = server.predict(model, prompt=prompt, max_tokens=8)
        assert r.status == 200, r.text
        ids.append(r.json()["choices"][0]["token_ids"])
    return ids


@pytest.mark.parametrize("model, level", [("tinytp", 2), ("smoltp", 3)])
def test_greedy_output_equals_tp1(server, expected, model, level):
    worker = observe.worker(server, model)
    assert len(rank_pids(worker["pid"])) == level - 1
    [desc] = server.get("management", f"/models/{model}").json()
    assert desc["parallelLevel"] == level
    assert greedy(server, model) == expected[model]


def test_kill_9_of_a_rank_mid_stream_restarts_the_group(server, expected):
    before = observe.worker(server, "tinytp")
    [rank] = rank_pids(before["pid"])
    body = {"model": "tinytp", "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True}
    events = observe.stream_and_signal(server, body, after=3, pid=rank, sig=signal.SIGKILL)
    assert events[-1] == b"[DONE]" and len(events) < 400  # after the error event
    error = events[-2]["error"]
    assert error["code"] == 503, error
    assert f"rank 1 (pid {rank}) was killed by SIGKILL" in error["message"]

    # The worker (rank 0) exits on the failure; the supervisor starts the whole group again.
    server.wait_for(
        lambda: (w := observe.worker(server, "tinytp"))["status"] == "READY" and w["pid"] != before["pid"],
        timeout=180,
        what="the group restarted",
    )
    after = observe.worker(server, "tinytp")
    assert after["restarts"] == 1
    [new_rank] = rank_pids(after["pid"])
    assert new_rank != rank
    assert not os.path.exists(f"/proc/{before['pid']}/cmdline") or not rank_pids(before["pid"])
    assert greedy(server, "tinytp") == expected["tinytp"]


def test_registering_a_size_the_model_cannot_split_is_a_400_naming_it(server):
    r = server.post("management", "/models?url=three.mar")
    assert r.status == 400, r.text
    assert "tensor_parallel_size=2 does not divide the model's 3 query heads" in r.json()["message"]
