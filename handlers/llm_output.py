"""Engine outputs -> /predictions response bodies (whole, or one JSON object per stream chunk),
plus the `timings` and `usage` records every response carries."""

from __future__ import annotations

from typing import Any

from pagedserve.engine.request.outputs import FinishReason, RequestOutput, TokenLogprob
from pagedserve.handlers.deltas import ChoiceDelta

TIMING_KEYS = ("queued_s", "prefill_s", "decode_s", "ttft_s")


def timings(out: RequestOutput, total_s: float | None = None) -> dict[str, Any]:
    """Per-request timings from the engine's metrics (seconds; None where unknown), the
    prompt tokens served from the prefix cache (and restored from the KV offload tiers) and why
    the others were not (`prefix_cache_miss`: its cause and tokens, or None).
    `total_s` is the front end's own measure."""
    m = out.metrics
    record: dict[str, Any] = {key: None if m is None else _rounded(getattr(m, key)) for key in TIMING_KEYS}
    record["cached_prompt_tokens"] = out.num_cached_tokens
    record["offloaded_prompt_tokens"] = out.num_external_cached_tokens  # restored from LMCache
    if out.disagg is not None:  # served by a prefill and a decode worker (or fallen back)
        d = out.disagg
        record["disagg"] = {
            "path": d.path.value,
            "reason": d.reason,
            "prefill_worker": d.prefill_worker,
            "decode_worker": d.decode_worker,
            "queue_s": _rounded(d.queue_s),
            "prefill_s": _rounded(d.prefill_s),
            "transfer_s": _rounded(d.transfer_s),
            "first_decode_s": _rounded(d.first_decode_s),
            "transfer_bytes": d.transfer_bytes,
        }
    # Why full prompt blocks were not reused from the prefix cache (docs/concepts/prefix-cache.md).
    miss = out.prefix_miss
    record["prefix_cache_miss"] = None if miss is None else {"cause": miss[0], "tokens": miss[1]}
    if total_s is not None:
        record["total_s"] = _rounded(total_s)
    return record


def usage(out: RequestOutput) -> dict[str, int]:
    prompt_tokens = len(out.prompt_token_ids)
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "cached_prompt_tokens": out.num_cached_tokens,
    }


def prediction_response(
    model: str, out: RequestOutput, request_id: str | None = None, total_s: float | None = None
) -> dict[str, Any]:
    """The whole reply of POST /predictions/{model} for a finished request."""
    body: dict[str, Any] = {"model": model}
    if request_id is not None:
        body["id"] = request_id
    body["choices"] = [
        _choice(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs, c.error) for c in out.outputs
    ]
    body["usage"] = usage(out)
    body["timings"] = timings(out, total_s)
    return body


def prediction_chunk(model: str, request_id: str, deltas: list[ChoiceDelta]) -> dict[str, Any]:
    """One line of a chunked /predictions stream: what each choice gained."""
    return {
        "id": request_id,
        "model": model,
        "choices": [
            _choice(d.index, d.text, d.token_ids, d.finish_reason, d.stop_reason, d.logprobs, d.error) for d in deltas
        ],
    }


def _choice(
    index: int,
    text: str,
    token_ids: list[int],
    finish_reason: FinishReason | None,
    stop_reason: int | str | None,
    logprobs: list[dict[int, TokenLogprob]] | None,
    error: str | None,
) -> dict[str, Any]:
    """One choice of a reply or a stream chunk; `error` only when the engine ended it early."""
    choice = {
        "index": index,
        "text": text,
        "token_ids": token_ids,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "logprobs": logprobs_list(logprobs),
    }
    if error is not None:
        choice["error"] = error
    return choice


def logprobs_list(entries: list[dict[int, TokenLogprob]] | None) -> list[dict[str, Any]] | None:
    """Per generated token: {token id: {logprob, rank, token}} (sampled token first)."""
    if entries is None:
        return None
    return [
        {str(tok): {"logprob": lp.logprob, "rank": lp.rank, "token": lp.decoded_token} for tok, lp in entry.items()}
        for entry in entries
    ]


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(float(value), 6)
