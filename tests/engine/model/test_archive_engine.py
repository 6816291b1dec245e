"""Archives of the real default model open in the engine and generate what the source directory
generates, as a `.mar` and as a plain folder; a tampered extraction is caught when it is reopened.
The `.tar.gz` format's round trip is checked byte for byte on a small model
(tests/engine/model/test_archive.py, tests/server/commands/test_archive_cli.py): with the real
model's 541 MB of float32 weights, gzip alone took ~17 s of this module's CPU."""

from __future__ import annotations

import pytest

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.model.archive import ArchiveError, write_archive
from pagedserve.engine.model.model_source import resolve_model_dir

pytestmark = pytest.mark.slow

PROMPT = "1, 2, 3, 4,"
PARAMS = SamplingParams(max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def expected_text(default_model_dir) -> str:
    llm = LLM(default_model_dir, dtype="float32", kv_cache_memory="64MiB", max_model_len=512)
    return llm.generate(PROMPT, PARAMS)[0].outputs[0].text


@pytest.mark.parametrize("fmt", ["default", "no-archive"])
def test_round_trip_generates_the_same_text(default_model_dir, expected_text, tmp_path, monkeypatch, fmt):
    monkeypatch.setenv("PAGEDSERVE_ARCHIVE_DIR", str(tmp_path / "extracted"))
    archive = write_archive(
        default_model_dir, tmp_path / "store", model_name="smollm2", version="1.0", archive_format=fmt
    )
    llm = LLM(archive, dtype="float32", kv_cache_memory="64MiB", max_model_len=512)
    text = llm.generate(PROMPT, PARAMS)[0].outputs[0].text
    assert text == expected_text and text.startswith(" 5, 6, 7")


def test_tampered_extraction_is_reextracted_and_bad_archive_refused(default_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_ARCHIVE_DIR", str(tmp_path / "extracted"))
    archive = write_archive(default_model_dir, tmp_path / "store", model_name="smollm2", version="1.0")
    root = resolve_model_dir(archive)
    (root / "generation_config.json").write_text("{}")  # tamper with the cached extraction
    again = resolve_model_dir(archive)
    assert again == root and (again / "generation_config.json").read_text() != "{}"
    broken = tmp_path / "broken.mar"
    broken.write_bytes(archive.read_bytes()[: 1 << 20])
    with pytest.raises(ArchiveError):
        LLM(broken, dtype="float32", kv_cache_memory="64MiB")
