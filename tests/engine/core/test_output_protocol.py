"""The typed engine output protocol and the one place requests fan out, without an engine:
OutputProcessor with the real tokenizer, fed EngineCoreOutputs as a worker would send them
(through the wire codec)."""

from __future__ import annotations

import msgspec
import pytest

from pagedserve.engine.core.messages import EngineCoreOutputs, EngineCoreRequest, make_event_decoder, make_input_decoder
from pagedserve.engine.core.output_processor import OutputProcessor
from pagedserve.engine.model.tokenizer import load_tokenizer
from pagedserve.engine.request.inputs import EngineInput
from pagedserve.engine.request.outputs import FinishReason, RequestMetrics, RequestOutput
from pagedserve.engine.sampling.params import SamplingParams
from pagedserve.engine.scheduler.output import EngineCoreOutput
from pagedserve.engine.scheduler.stats import SchedulerStats
from pagedserve.handlers.llm_output import timings


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


def over_the_wire(*outputs: EngineCoreOutput) -> list[EngineCoreOutput]:
    """What the front end decodes after the worker sent these."""
    data = msgspec.msgpack.encode(EngineCoreOutputs(list(outputs), SchedulerStats()))
    return make_event_decoder().decode(data).outputs


def test_n_fans_out_once_into_engine_requests(tokenizer):
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=4)
    requests = processor.add_request("r", EngineInput("hi", [1, 2], params), priority=2, arrival_time=5.0)
    assert [r.request_id for r in requests] == ["0_r", "1_r", "2_r"]
    assert [r.sampling_params.seed for r in requests] == [7, 8, 9]
    assert all(r.sampling_params.n == 1 and r.priority == 2 and r.arrival_time == 5.0 for r in requests)
    (single,) = processor.add_request("s", EngineInput(None, [1, 2], SamplingParams()))
    assert single.request_id == "s" and single.arrival_time is None  # None: stamped on arrival
    decoded = make_input_decoder().decode(msgspec.msgpack.encode(single))
    assert isinstance(decoded, EngineCoreRequest) and decoded.arrival_time is None
    with pytest.raises(ValueError, match="duplicate"):
        processor.add_request("r", EngineInput(None, [1], params))


def test_an_engine_error_is_its_own_field(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("g", EngineInput(None, [1, 2], SamplingParams()))
    (eco,) = over_the_wire(
        EngineCoreOutput("g", [], finish_reason=FinishReason.ABORT, error="grammar compilation timed out")
    )
    assert eco.finish_reason is FinishReason.ABORT and eco.first_scheduled_time is None
    (out,), to_abort = processor.process_outputs([eco])
    c = out.outputs[0]
    assert out.finished and not to_abort
    assert c.finish_reason is FinishReason.ABORT and c.finish_reason == "abort"
    assert c.error == "grammar compilation timed out" and c.stop_reason is None
    assert out.refusal == "grammar compilation timed out"


def test_stops_carry_their_reason_and_no_error(tokenizer):
    processor = OutputProcessor(tokenizer)
    comma = tokenizer.encode(",", add_special_tokens=False)[0]
    ids = tokenizer.encode(" 5, 6, 7", add_special_tokens=False)
    processor.add_request("t", EngineInput(None, [1], SamplingParams()))
    processor.add_request("s", EngineInput(None, [1], SamplingParams(stop=[" 6"])))
    outs, to_abort = processor.process_outputs(
        over_the_wire(
            EngineCoreOutput(
                "t", [comma], finish_reason=FinishReason.STOP, stop_reason=comma, first_scheduled_time=1.0
            ),
            EngineCoreOutput("s", ids),
        )
    )
    by_id = {o.request_id: o.outputs[0] for o in outs}
    assert by_id["t"].finish_reason is FinishReason.STOP and by_id["t"].stop_reason == comma
    # The detokenizer found the stop string: the engine must be told to stop the request.
    assert by_id["s"].finish_reason is FinishReason.STOP and by_id["s"].stop_reason == " 6"
    assert by_id["s"].text == " 5," and to_abort == ["s"]
    assert all(c.error is None for c in by_id.values())
    assert all(o.refusal is None for o in outs)


def test_abort_marks_unfinished_choices(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("a", EngineInput(None, [1], SamplingParams(n=2)))
    processor.process_outputs([EngineCoreOutput("0_a", [5], finish_reason=FinishReason.LENGTH)])
    out = processor.mark_aborted("a")
    assert [c.finish_reason for c in out.outputs] == [FinishReason.LENGTH, FinishReason.ABORT]
    assert out.finished and out.refusal is None
    assert processor.abort_request("a") == ["1_a"]


def test_metrics_are_a_record_or_none():
    m = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0, finished_time=13.0)
    assert (m.queued_s, m.prefill_s, m.ttft_s, m.decode_s) == (0.5, 0.5, 1.0, 2.0)
    out = RequestOutput("r", None, [1, 2], [], finished=True, metrics=m)
    assert timings(out, 3.5) == {
        "queued_s": 0.5,
        "prefill_s": 0.5,
        "decode_s": 2.0,
        "ttft_s": 1.0,
        "cached_prompt_tokens": 0,
        "offloaded_prompt_tokens": 0,
        "prefix_cache_miss": None,
        "total_s": 3.5,
    }
    offline = RequestOutput("r", None, [1, 2], [], finished=True)  # no worker measured it
    assert offline.metrics is None
    assert timings(offline)["ttft_s"] is None and timings(offline)["queued_s"] is None
