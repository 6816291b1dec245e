"""What a benchmark sends: prompts (random or from a file) with their output lengths, and when
(all at once under a concurrency cap, or Poisson arrivals at a request rate).

Nothing here knows the model: random prompts are random common English words (about one token
each with a leading space in a byte-level BPE vocabulary); the server's `usage` tells the real
prompt length, and the results count that.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

WORDS = (
    "the of and to in is it you that he was for on are with as his they be at one have this from "
    "or had by word but what some we can out other were all there when up use your how said an "
    "each she which do their time if will way about many then them write would like so these her "
    "long make thing see him two has look more day could go come did number sound no most people "
    "my over know water than call first who may down side been now find any new work part take "
    "get place made live where after back little only round man year came show every good me give "
    "our under name very through just form sentence great think say help low line differ turn "
    "cause much mean before move right boy old too same tell does set three want air well also "
    "play small end put home read hand port large spell add even land here must big high such"
).split()


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt: str
    max_tokens: int


def random_requests(
    num: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0
) -> list[BenchRequest]:
    """`num` prompts of about `input_len` words, each asking for `output_len` tokens; with
    `range_ratio` r, both lengths are drawn uniformly from [len * (1 - r), len * (1 + r)]."""
    if num < 1 or input_len < 1 or output_len < 1:
        raise ValueError("num-prompts, input and output lengths must be >= 1")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"random-range-ratio: must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)

    def length(center: int) -> int:
        low, high = max(1, int(center * (1 - range_ratio))), max(1, int(center * (1 + range_ratio)))
        return rng.randint(low, high)

    # A distinct first word per request keeps them from sharing a cached prefix by accident.
    return [
        BenchRequest(f"{i}: " + " ".join(rng.choices(WORDS, k=length(input_len))), length(output_len))
        for i in range(num)
    ]


def file_requests(path: str | Path, num: int, output_len: int) -> list[BenchRequest]:
    """Prompts from a file: `.jsonl` (one object a line with `prompt` and optionally
    `max_tokens` / `output_len`), `.json` (a list of such objects or of strings), or plain text
    (one prompt a line). Cycled if the file has fewer than `num`; `output_len` where a prompt
    gives none."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
    elif path.suffix == ".json":
        items = json.loads(text)
        if not isinstance(items, list):
            raise ValueError(f"{path}: a .json dataset must be a list")
    else:
        items = [line for line in text.splitlines() if line.strip()]
    requests = [_item(path, i, item, output_len) for i, item in enumerate(items)]
    if not requests:
        raise ValueError(f"{path}: no prompts")
    return [requests[i % len(requests)] for i in range(num)]


def _item(path: Path, index: int, item, output_len: int) -> BenchRequest:
    if isinstance(item, str):
        return BenchRequest(item, output_len)
    if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
        raise ValueError(f"{path}: entry {index} needs a string 'prompt'")
    tokens = item.get("max_tokens", item.get("output_len", output_len))
    if not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"{path}: entry {index}: max_tokens must be an integer >= 1")
    return BenchRequest(item["prompt"], tokens)


def arrival_gaps(num: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> Iterator[float]:
    """Seconds to wait before each request: 0 for an infinite rate, else gamma-distributed gaps
    with mean 1 / rate (burstiness 1: a Poisson process; lower: burstier)."""
    if request_rate <= 0:
        raise ValueError(f"request-rate: must be > 0, got {request_rate}")
    rng = random.Random(seed)
    for i in range(num):
        if i == 0 or math.isinf(request_rate):
            yield 0.0
        else:
            yield rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))
