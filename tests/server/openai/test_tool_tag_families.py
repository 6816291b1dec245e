"""`tool_choice: "auto"` bound by structural tags, per chat-template family, through the
official `openai` SDK against a real in-process server: tiny random-weight models with each
family's chat template and tool parser (Llama 3 `llama3_json`, Qwen and Hermes-style `hermes`
with the tools in the template, Gemma 3 with the Hermes preamble, Mistral `mistral`). Each
family's trigger is one added token, made likely through `logit_bias` (a random model would
never write it): the model writes text, then the trigger, after which the grammar binds the
call, so its arguments validate against the tool's schema."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.server.conftest import InProcessFactory

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
transformers = pytest.importorskip("transformers")

TRIGGERS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>"]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

_TURNS = "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
_GEN = "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
TEMPLATES = {
    # Llama 3.1: tools in a system header, calls as JSON.
    "llama3": (
        "{{- bos_token }}{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
        'Respond with JSON {"name": function name, "parameters": arguments}.\n'
        "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{%- endif %}"
        "{%- for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}"
        "<|eot_id|>{%- endfor %}{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
        "{% endif %}",
        "llama3_json",
        "<|python_tag|>",
    ),
    # Qwen 2.5: a tools section in the system turn, calls in <tool_call> tags.
    "qwen": (
        "{%- if tools %}<|im_start|>system\n# Tools\n\n<tools>{% for t in tools %}\n{{ t | tojson }}"
        "{% endfor %}\n</tools>\n\nFor each function call, return a json object within <tool_call></tool_call> "
        "XML tags.<|im_end|>\n{% endif %}" + _TURNS + _GEN,
        "hermes",
        "<tool_call>",
    ),
    # Hermes-style: the default model's own template (no tools section: the Hermes preamble).
    "hermes": (None, "hermes", "<tool_call>"),
    # Gemma 3: no system role, no tools section (the Hermes preamble goes into the first turn).
    "gemma": (
        "{{ bos_token }}{%- for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}"
        "\n{{ m['content'] }}<end_of_turn>\n{% endfor %}{%- if add_generation_prompt %}<start_of_turn>model\n"
        "{% endif %}",
        "hermes",
        "<tool_call>",
    ),
    # Mistral (v3 tokenizer): [AVAILABLE_TOOLS] before the last [INST], calls after [TOOL_CALLS].
    "mistral": (
        "{{ bos_token }}{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
        "{%- for m in messages %}{%- if m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
        "{%- else %}[INST]{{ m['content'] }}[/INST]{% endif %}{% endfor %}",
        "mistral",
        "[TOOL_CALLS]",
    ),
}


@pytest.fixture(scope="module")
def family_server(tmp_path_factory, inprocess_factory: InProcessFactory):
    """One in-process server with a tiny random model per family (one shared set of weights,
    the default model's tokenizer with the triggers as added tokens)."""
    import torch

    from pagedserve.engine.model.archive import write_archive
    from pagedserve.engine.model.default_model import default_model_dir

    try:
        source = default_model_dir()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    base = tmp_path_factory.mktemp("families") / "base"
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    tokenizer.add_tokens(TRIGGERS)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tie_word_embeddings=True,
    )
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(base, safe_serialization=True)
    store = tmp_path_factory.mktemp("families-store")
    for family, (template, parser, _) in TEMPLATES.items():
        model = base.parent / family
        shutil.copytree(base, model, copy_function=os.link)  # the same weights: hard links
        tokenizer.chat_template = template if template is not None else (source / "chat_template.jinja").read_text()
        tokenizer.save_pretrained(model)
        model_config = model.parent / f"{family}.yaml"
        model_config.write_text(
            f"toolParser: {parser}\nhandler:\n  dtype: float32\n  max_model_len: 1024\n  kv_cache_memory: 8MiB\n"
        )
        write_archive(model, store, model_name=family, version="1.0", config_file=model_config)
        shutil.rmtree(model)
    shutil.rmtree(base)
    server = inprocess_factory(model_store=str(store), load_models=[f"{f}={f}.mar" for f in TEMPLATES])
    return server, tokenizer


def _client(server):
    return openai.OpenAI(
        base_url=server.url("inference", "/v1"), api_key=server.keys["inference"], max_retries=0, timeout=120
    )


def _bias(tokenizer, trigger: str) -> dict[str, float]:
    """The trigger about a third likely at each step of free text (the random model's logits
    are ~0 over ~49k tokens); a string's closing quote a little likelier, so calls end soon."""
    return {str(tokenizer.convert_tokens_to_ids(trigger)): 10.0, str(tokenizer.encode('"')[0]): 6.0}


@pytest.mark.parametrize("family", list(TEMPLATES))
def test_text_then_a_call_whose_arguments_validate(family_server, family):
    server, tokenizer = family_server
    trigger = TEMPLATES[family][2]
    r = _client(server).chat.completions.create(
        model=family,
        messages=ASK,
        tools=TOOLS,
        tool_choice="auto",
        parallel_tool_calls=False,
        logit_bias=_bias(tokenizer, trigger),
        temperature=1.0,
        seed=7,
        n=3,
        max_tokens=200,
    )
    with_text = 0
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        with_text += bool(choice.message.content)
    assert with_text >= 1  # some choices wrote text before their call


def test_structural_tag_as_a_request_option(family_server):
    """`structured_outputs.structural_tag` on any request: text, then the tag's schema."""
    server, tokenizer = family_server
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<tool_call>"],
            "tags": [
                {
                    "type": "tag",
                    "begin": "<tool_call>",
                    "content": {"type": "json_schema", "json_schema": WEATHER},
                    "end": "</tool_call>",
                }
            ],
            "stop_after_first": True,
        },
    }
    r = _client(server).completions.create(
        model="hermes",
        prompt="Weather:",
        max_tokens=300,
        temperature=1.0,
        seed=3,
        logit_bias=_bias(tokenizer, "<tool_call>"),
        extra_body={"structured_outputs": {"structural_tag": tag}},
    )
    text = r.choices[0].text
    body = text[text.index("<tool_call>") + len("<tool_call>") : text.index("</tool_call>")]
    jsonschema.validate(json.loads(body), WEATHER)
    bad = _client(server).with_options(max_retries=0)
    with pytest.raises(openai.BadRequestError, match="structural_tag"):
        bad.completions.create(
            model="hermes", prompt="x", extra_body={"structured_outputs": {"structural_tag": {"type": "nope"}}}
        )
