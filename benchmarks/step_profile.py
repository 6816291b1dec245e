"""Where an offline engine's step time goes: `StepProfile.attach(llm)` times its parts.

The timers are wrappers put around one `engine.LLM`'s methods and forward hooks on its model's
linear layers, attached only when a benchmark asks for a profile (`--profile`): an engine that
is not profiled runs its own code untouched, so the profile costs nothing when off. On a CPU
every torch op is synchronous, so wall-clock timers around a call measure that call.

Parts (seconds over the profiled run):
- schedule: `Scheduler.schedule` + `Scheduler.update_from_output`
- prepare inputs: the model runner's `_update_states` + `_prepare_inputs`
- forward: the model's forward, split into matmul (every linear layer, hooks), attention (the
  attention backend's `forward`) and rest (embedding, norms, RoPE, activations, glue)
- logits: `compute_logits` (the LM head matmul)
- sample: the sampler, plus what else `execute_model` does (sampling metadata, bookkeeping)
- output processing: the `OutputProcessor` minus detokenization
- detokenize: the incremental detokenizers' `update` and `finish` calls
- other: the run's wall time not in any part (the LLM loop, engine core glue)

`OutputProcessor.process_outputs` and the detokenizer's methods are wrapped on their classes
(the offline LLM makes a processor per call): use the profile as a context manager, which
removes every wrapper and hook on exit.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

PARTS = (
    "schedule",
    "prepare inputs",
    "forward: matmul",
    "forward: attention",
    "forward: rest",
    "logits",
    "sample",
    "output processing",
    "detokenize",
    "other",
)


class StepProfile:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> StepProfile:  # noqa: PYI034 -- Python 3.10 has no typing.Self
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def detach(self) -> None:
        """Remove every wrapper and hook (the engine runs its own code again)."""
        while self._undo:
            self._undo.pop()()

    def _wrap(self, owner, name: str, key: str, count_step: bool = False) -> None:
        method = getattr(owner, name)
        seconds = self.seconds
        if name in vars(owner):  # defined on owner itself (a class): put the original back
            original = vars(owner)[name]
            self._undo.append(lambda: setattr(owner, name, original))
        else:  # an instance's method: drop the instance attribute
            self._undo.append(lambda: delattr(owner, name))

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[key] += time.perf_counter() - start
                if count_step:
                    self.steps += 1

        setattr(owner, name, timed)

    def attach(self, llm) -> StepProfile:
        """Time `llm`'s parts from now on; returns self."""
        from torch import nn

        from pagedserve.engine.core.output_processor import OutputProcessor
        from pagedserve.engine.request.detokenizer import IncrementalDetokenizer

        core = llm.engine
        runner = core.runner
        self._wrap(core.scheduler, "schedule", "schedule")
        self._wrap(core.scheduler, "update_from_output", "schedule")
        self._wrap(core, "step", "step", count_step=True)
        self._wrap(runner, "_update_states", "prepare inputs")
        self._wrap(runner, "_prepare_inputs", "prepare inputs")
        self._wrap(runner, "execute_model", "execute_model")
        self._wrap(runner.model, "forward", "forward")
        self._wrap(runner.model, "compute_logits", "logits")
        backend = runner.model.model.layers[0].self_attn.backend  # one backend for all layers
        self._wrap(backend, "forward", "forward: attention")
        self._wrap(OutputProcessor, "process_outputs", "process_outputs")
        self._wrap(IncrementalDetokenizer, "update", "detokenize")
        self._wrap(IncrementalDetokenizer, "finish", "detokenize")
        for module in runner.model.model.modules():
            if isinstance(module, nn.Linear) or type(module).__name__.endswith("Linear"):
                self._hook(module)
        return self

    def _hook(self, module) -> None:
        seconds, starts = self.seconds, []
        pre = module.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter()))

        def done(*_):
            seconds["forward: matmul"] += time.perf_counter() - starts.pop()

        post = module.register_forward_hook(done)
        self._undo += [pre.remove, post.remove]

    def breakdown(self, wall_s: float) -> dict[str, float]:
        """Seconds per part of PARTS (they add up to `wall_s`)."""
        s = self.seconds
        parts = {
            "schedule": s["schedule"],
            "prepare inputs": s["prepare inputs"],
            "forward: matmul": s["forward: matmul"],
            "forward: attention": s["forward: attention"],
            "forward: rest": s["forward"] - s["forward: matmul"] - s["forward: attention"],
            "logits": s["logits"],
            "sample": s["execute_model"] - s["prepare inputs"] - s["forward"] - s["logits"],
            "output processing": s["process_outputs"] - s["detokenize"],
            "detokenize": s["detokenize"],
        }
        parts["other"] = wall_s - sum(parts.values())
        return parts


def format_breakdown(parts: dict[str, float], steps: int, out: Callable[[str], None] = print) -> list[str]:
    """A markdown table of `parts`: seconds, ms per step and share of the run."""
    total = sum(parts.values())
    lines = ["| part | s | ms / step | share |", "| --- | --- | --- | --- |"]
    for name in PARTS:
        value = parts[name]
        lines.append(f"| {name} | {value:.2f} | {1000 * value / max(1, steps):.2f} | {100 * value / total:.1f} % |")
    lines.append(f"| total ({steps} steps) | {total:.2f} | {1000 * total / max(1, steps):.2f} | 100 % |")
    for line in lines:
        out(line)
    return lines


def profile_page(result: dict, args) -> list[str]:
    """The results page of one `offline_throughput.py --profile` run (its child's `result`)."""
    from _common import provenance, stamp

    md = [
        "# Offline engine step breakdown (latest `--profile` run)",
        "",
        stamp(provenance()),
        "",
        (
            f"{args.num_prompts} prompts x {args.prompt_len} tokens, {args.output_len} output tokens, {args.dtype}, "
            f"2 threads, prefix caching on; one run: {result['tok_per_s']:.1f} tok/s with the timers on."
        ),
        "",
    ]
    md += format_breakdown(result["breakdown_s"], result["steps"], out=lambda _: None)
    return md + ["", f"Run on {time.strftime('%Y-%m-%d %H:%M')}.", "Parts: see benchmarks/step_profile.py."]
