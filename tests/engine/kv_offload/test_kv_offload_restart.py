"""KV offload across processes: a new engine process on the same disk folder gets disk hits
and the same output; a full disk (writes failing with EFBIG under RLIMIT_FSIZE) costs counted
warnings, never output. Each engine runs in its own process, which must exit by itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> list[list[int]]:
    from pagedserve.engine.model.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    text = "Shipping log.\n" + "\n".join(f"Crate {i} holds {i * 3 % 11 + 1} tins of tea." for i in range(20))
    long = tok.encode(text, add_special_tokens=False)
    assert len(long) > 256 and len(long) % 64 > 1
    return [long, long[:130] + tok.encode(" And then the ship sailed away.", add_special_tokens=False)]


@pytest.fixture(scope="module")
def reference(default_model_dir, prompts) -> list[list[int]]:
    llm = LLM(default_model_dir, dtype="float32", num_threads=1, num_kv_blocks=40, max_model_len=640)
    return [llm.generate([p], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].token_ids for p in prompts]


def run_child(model_dir, prompts, disk, tmp_path, *extra) -> dict:
    prompt_file = tmp_path / "prompts.json"
    prompt_file.write_text(json.dumps(prompts))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.engine.kv_offload_child", str(model_dir), str(prompt_file), str(disk), *extra],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_restart_serves_disk_hits_with_identical_output(default_model_dir, prompts, reference, tmp_path):
    disk = tmp_path / "kv"
    first = run_child(default_model_dir, prompts, disk, tmp_path)
    assert first["tokens"] == reference and first["flushed"]
    assert first["stats"]["hit_tokens_disk"] == 0 and first["stats"]["faults"] == 0
    assert len(list(disk.glob("*.data"))) == first["stats"]["stored_chunks"]
    second = run_child(default_model_dir, prompts, disk, tmp_path)  # a new process
    assert second["tokens"] == reference
    stats = second["stats"]
    # The long prompt comes from disk but its last block; the second prompt shares a prefix with
    # it that the engine's own pool still holds by then (its own tail is also on disk).
    assert stats["hit_tokens_disk"] >= (len(prompts[0]) - 1) // 16 * 16 and stats["faults"] == 0
    assert stats["stored_tokens"] == 0  # everything was already on disk


def test_full_disk_costs_warnings_not_output(default_model_dir, prompts, reference, tmp_path):
    disk = tmp_path / "kv"
    out = run_child(default_model_dir, prompts, disk, tmp_path, "--max-file-bytes", str(64 * 1024))
    assert out["tokens"] == reference
    stats = out["stats"]
    assert stats["fault_kinds"] == {"disk_write": stats["stored_chunks"]} and stats["faults"] > 0
    assert list(disk.glob("*.data")) == []
