"""A request's `keep_alive` on the custom-handler path (issue 34: it was ignored there, and the
handler saw a field it did not ask for): the server takes it, as on the built-in path."""

from __future__ import annotations

import pytest

HANDLER = "from pagedserve.handlers import LLMHandler\n\n\nclass JsonHandler(LLMHandler):\n    pass\n"


@pytest.fixture(scope="module")
def srv(inprocess_factory, tiny_model, tiny_store, tmp_path_factory):
    from pagedserve.engine.model.archive import write_archive

    tmp = tmp_path_factory.mktemp("custom-keep-alive")
    (tmp / "json_handler.py").write_text(HANDLER)
    (tmp / "model-config.yaml").write_text(
        "minWorkers: 0\nmaxWorkers: 1\nkeepAlive: 600\nhandler:\n  max_model_len: 256\n  kv_cache_memory: 8MiB\n"
    )
    write_archive(
        tiny_model,
        tiny_store / "custom-ka",
        model_name="customka",
        version="1.0",
        handler=str(tmp / "json_handler.py"),
        config_file=tmp / "model-config.yaml",
        force=True,
    )
    return inprocess_factory(load_models=["customka=custom-ka/customka.mar"], allow_custom_handlers=True)


def _state(srv) -> str:
    return srv.get("management", "/models/customka").json()[0]["state"]


def test_keep_alive_zero_unloads_a_custom_handler_model_right_after_the_request(srv):
    r = srv.post("inference", "/predictions/customka", json={"prompt": "1, 2, 3,", "max_tokens": 2, "keep_alive": 0})
    assert r.status == 200, r.text
    srv.wait_for(lambda: _state(srv) == "unloaded", 60, what="unloaded after keep_alive 0")


def test_a_bad_keep_alive_is_a_400_naming_the_field(srv):
    r = srv.post("inference", "/predictions/customka", json={"prompt": "hi", "max_tokens": 2, "keep_alive": "soon"})
    assert r.status == 400 and "keep_alive" in r.json()["message"], r.text
