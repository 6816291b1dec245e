"""The built-in llm handler on an archive of the real default model: a TorchServe-style batch
with valid and invalid requests; bad ones get a 400-style error, the others their text."""

from __future__ import annotations

import json

import pytest

from pagedserve.engine import LLM
from pagedserve.engine.model.archive import open_archive, write_archive
from pagedserve.handlers import BUILTIN_HANDLERS, Context
from pagedserve.handlers.llm_handler import handle_batch

pytestmark = pytest.mark.slow

MODEL_CONFIG = b"""\
minWorkers: 1
maxWorkers: 2
handler:
  dtype: float32
  kv_cache_memory: 64MiB
  max_model_len: 1024
"""


@pytest.fixture(scope="module")
def handler_and_llm(default_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("handler")
    config = tmp / "model-config.yaml"
    config.write_bytes(MODEL_CONFIG)
    archive = write_archive(
        default_model_dir,
        tmp / "store",
        model_name="smollm2",
        version="1.0",
        config_file=config,
        archive_format="no-archive",
    )
    opened = open_archive(archive, tmp / "unused")
    from pagedserve.engine.model.model_config import load_model_config

    context = Context("smollm2", opened.root, opened.manifest, load_model_config(opened.model_config))
    handler = BUILTIN_HANDLERS[opened.manifest["model"]["handler"]]()
    handler.initialize(context)
    return handler, LLM(context.model_dir, **context.model_config.engine_options())


def test_batch_with_good_and_bad_requests(handler_and_llm):
    handler, llm = handler_and_llm
    batch = [
        {"body": json.dumps({"prompt": "1, 2, 3, 4,", "max_tokens": 8, "temperature": 0}).encode()},
        {"data": {"messages": [{"role": "user", "content": "What is 2 plus 2?"}], "max_tokens": 40, "temperature": 0}},
        {"body": b"{not json"},
        {"body": {"prompt": "hi", "temperature": -1}},
        {"body": {"prompt": "hi", "max_tokens": 4, "frobnicate": True}},
        {"body": {"prompt": "x " * 2000}},
        {"body": {"prompt": [1, 2, 3], "n": 2, "seed": 3, "max_tokens": 3}},
        {"body": {"prompt": "hi", "stream": True}},
    ]
    responses = handle_batch(handler, llm, batch)
    assert llm.engine.config.dtype == "float32"  # the model-config's handler section applied
    assert len(responses) == len(batch)
    first, chat, bad_json, bad_temp, unknown, too_long, pair, stream = responses
    assert first["choices"][0]["text"].startswith(" 5, 6, 7") and first["choices"][0]["finish_reason"] == "length"
    assert first["usage"]["completion_tokens"] == 8 and first["model"] == "smollm2"
    assert "4" in chat["choices"][0]["text"] and chat["choices"][0]["finish_reason"] == "stop"
    assert bad_json["code"] == 400 and "JSON" in bad_json["message"]
    assert bad_temp["code"] == 400 and "temperature" in bad_temp["message"]
    assert unknown["code"] == 400 and "frobnicate" in unknown["message"]
    assert too_long["code"] == 400 and "max_model_len" in too_long["message"]
    assert [c["index"] for c in pair["choices"]] == [0, 1] and all(len(c["token_ids"]) == 3 for c in pair["choices"])
    assert stream["code"] == 400 and "stream" in stream["message"]
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.pool.get_num_free_blocks() == engine.runner.num_blocks
