"""A custom handler shipped in an archive, served with --allow-custom-handlers: its preprocess
reads a plain-text body (and a header), its postprocess writes the reply, around the server's
engine workers. Its refusals keep their status; its failures are 500s that say where, and the
model keeps serving. TorchServe's function entry point is refused at registration."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

HANDLER = '''
from pagedserve.handlers import HandlerError, LLMHandler
from pagedserve.handlers.llm_input import ParsedBody, PromptSpec, make_sampling_params
from plain_settings import MAX_TOKENS


class PlainText(LLMHandler):
    """text/plain bodies; X-Stream: 1 streams; a short JSON reply of its own."""

    def initialize(self, context):
        super().initialize(context)
        self.label = f"{context.model_config.handler_options['label']}:{context.model_name}"

    def parse(self, request):
        text = bytes(request["body"]).decode()
        if not text.strip():
            return HandlerError("say something (plain-text handler)", code=422)
        params = make_sampling_params({"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
        return ParsedBody(PromptSpec(text=text), params, stream=request["headers"].get("X-Stream") == "1")

    def postprocess(self, outputs):
        for out in outputs:
            if out.prompt == "boom":
                raise RuntimeError("the postprocess blew up")
        return [{"handler": self.label, "completion": out.outputs[0].text,
                 "tokens": len(out.outputs[0].token_ids)} for out in outputs]
'''


@pytest.fixture(scope="module")
def archives(model_store, tiny_model, tmp_path_factory):
    from pagedserve.engine.model.archive import write_archive

    tmp = tmp_path_factory.mktemp("custom")
    (tmp / "plain_handler.py").write_text(HANDLER)
    (tmp / "plain_settings.py").write_text("MAX_TOKENS = 5\n")
    (tmp / "fn_handler.py").write_text("def handle(data, context):\n    return data\n")
    (tmp / "model-config.yaml").write_text("handler:\n  max_num_seqs: 8\n  options:\n    label: txt\n")
    dest = model_store / "custom"
    write_archive(
        tiny_model,
        dest,
        model_name="plain",
        version="1.0",
        handler=str(tmp / "plain_handler.py"),
        extra_files=[tmp / "plain_settings.py"],
        config_file=tmp / "model-config.yaml",
        force=True,
    )
    write_archive(
        tiny_model, dest, model_name="fnhandler", version="1.0", handler=str(tmp / "fn_handler.py"), force=True
    )
    return {"plain": "custom/plain.mar", "function": "custom/fnhandler.mar"}


@pytest.fixture(scope="module")
def server(module_server_factory, archives):
    return module_server_factory(
        models=[f"plain={archives['plain']}"], args=["--allow-custom-handlers", "--enable-model-api"]
    )


def post_text(server, text: str, headers: dict[str, str] | None = None):
    return server.post(
        "inference", "/predictions/plain", data=text.encode(), headers={"Content-Type": "text/plain", **(headers or {})}
    )


def test_preprocess_and_postprocess_wrap_the_workers(server):
    r = post_text(server, "Once upon a time")
    assert r.status == 200, r.text
    body = r.json()
    # The label comes from model-config.yaml's handler.options, MAX_TOKENS from an extra file.
    assert body["handler"] == "txt:plain" and body["tokens"] == 5
    assert isinstance(body["completion"], str) and body["timings"]["total_s"] > 0
    assert r.headers.get("x-request-id")


def test_a_streamed_reply_keeps_the_built_in_chunks(server):
    r = post_text(server, "Once upon a time", {"X-Stream": "1"})
    assert r.status == 200, r.text
    chunks = [json.loads(line) for line in r.text.splitlines() if line.strip()]
    assert chunks and all("choices" in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 5


def test_handler_refusals_and_failures(server):
    refused = post_text(server, "   ")
    assert refused.status == 422 and "plain-text handler" in refused.json()["message"]
    failed = post_text(server, "boom")
    assert failed.status == 500 and "postprocess failed: RuntimeError" in failed.json()["message"]
    assert post_text(server, "still there?").status == 200


def test_openai_routes_skip_the_custom_handler(server):
    r = server.post("inference", "/v1/completions", json={"model": "plain", "prompt": "Hi", "max_tokens": 3})
    assert r.status == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3 and "handler" not in r.json()


def test_a_function_entry_point_is_refused_at_registration(server, archives):
    r = server.post("management", f"/models?url={archives['function']}&synchronous=true")
    assert r.status == 400, r.text
    assert "function entry point" in r.json()["message"]
    assert server.get("management", "/models/fnhandler").status == 404
