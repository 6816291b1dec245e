"""Adaptive speculation (`method: auto`): every step, how many drafts (0 included) each
decoding request gets, from its running acceptance rate and the measured cost of a step.

Cost model. For each batch size B (requests in a decode-only step) the engine reports the
step's time t and its number of draft tokens D; a least-squares line over the latest samples
gives t ~= t0(B) + b(B) * D (once MIN_SAMPLES steps with drafts and as many without are
kept: a few probes on a busy machine would give any slope). One draft token costs c = b / (t0 / B) tokens' worth of time (at
batch 1 on a CPU the weights are read once whatever the token count: c is small; at batch 32
a draft token costs nearly a whole sequence's token: c -> 1). Until drafts of different
lengths were measured at B, b is the slope of t0 over batch sizes, else PRIOR_COST x t0 / B.

Acceptance. Each request keeps an exponentially decayed count of kept drafts and of refusals
(a verification of k drafts that keeps m refused one if m < k); its rate alpha is the
per-token probability that a draft is kept, starting from the rate of all requests (at least
TRIAL_RATE: a request nothing of which was verified yet gets a first try).

Choice. Draft i is worth verifying when the chance it is reached and kept, alpha^i, times the
chance p that the drafter has anything for the request (its decayed share of asks that gave
drafts: asking costs indexing time), exceeds its cost c: k = max{i : p alpha^i > c}, capped by
num_speculative_tokens. A request at k = 0 drafts
one token every PROBE_STEPS / (1 - c) steps, so a rate that changes is noticed; at most one
request of the batch probes per step (the others wait their turn), so a batch that drafts
nothing pays for one 1-token draft now and then, not one per request.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

PRIOR_COST = 0.3  # c before anything is measured
DECAY = 0.9  # weight of a request's older verifications per new one
PROBE_STEPS = 25
SAMPLES = 64  # step-time samples kept per batch size
MIN_SAMPLES = 4
# A request's rate before any of its drafts was verified is at least this: a new request gets
# a first try (its first asks are cheap n-gram lookups) whatever earlier requests did.
TRIAL_RATE = 0.6


@dataclass(slots=True)
class _Rate:
    kept: float
    refused: float
    steps_at_zero: int = 0
    ever_kept: bool = False
    asked: float = 0.0  # decayed: proposals asked of the drafter, and those that drafted
    proposed: float = 0.0

    def yield_rate(self, weight: float = 2.0) -> float:
        """The chance that asking the drafter gives drafts (a request it has nothing for
        costs the asking and gains nothing)."""
        return (self.proposed + weight) / (self.asked + weight)

    def alpha(self, prior: float, weight: float = 2.0) -> float:
        if self.kept + self.refused == 0:  # nothing verified yet: worth a first try
            prior = max(prior, TRIAL_RATE)
        return (self.kept + prior * weight) / (self.kept + self.refused + weight)


@dataclass(slots=True)
class AdaptiveStats:
    requests_drafted: int = 0  # cumulative: (request, step) pairs given >= 1 draft
    requests_skipped: int = 0  # cumulative: pairs that could have drafted and were given 0
    acceptance_rate: float = 0.0  # per draft token, all requests, decayed
    cost_ratio: float = PRIOR_COST  # c at the last batch size seen


@dataclass(slots=True)
class AdaptiveSpeculation:
    max_tokens: int
    _rates: dict[str, _Rate] = field(default_factory=dict)
    _samples: dict[int, deque] = field(default_factory=dict)  # B -> (D, t) samples
    _kept: float = 0.0  # all requests, decayed
    _refused: float = 0.0
    _fits: dict[int, tuple[float, float]] = field(default_factory=dict)  # B -> (t0, b), cached
    stats: AdaptiveStats = field(default_factory=AdaptiveStats)
    probed: bool = False  # the last num_drafts was a probe

    # -- measurements --------------------------------------------------------------------
    def observe_step(self, batch_size: int, num_drafts: int, seconds: float) -> None:
        """A decode-only step of `batch_size` requests that verified `num_drafts` drafts."""
        samples = self._samples.setdefault(batch_size, deque(maxlen=SAMPLES))
        samples.append((num_drafts, seconds))
        self._fits.pop(batch_size, None)

    def observe_verification(self, req_id: str, num_drafts: int, num_kept: int) -> None:
        rate = self._rates.setdefault(req_id, _Rate(0.0, 0.0))
        refused = 1.0 if num_kept < num_drafts else 0.0
        rate.kept = rate.kept * DECAY + num_kept
        rate.ever_kept |= num_kept > 0
        rate.refused = rate.refused * DECAY + refused
        self._kept = self._kept * 0.99 + num_kept
        self._refused = self._refused * 0.99 + refused
        self.stats.acceptance_rate = self.global_rate()

    def observe_proposal(self, req_id: str, drafted: bool) -> None:
        """The drafter was asked for this request's drafts; `drafted`: it had some."""
        rate = self._rates.get(req_id)
        if rate is not None:
            rate.asked = rate.asked * DECAY + 1.0
            rate.proposed = rate.proposed * DECAY + float(drafted)

    def forget(self, req_id: str) -> None:
        self._rates.pop(req_id, None)

    def live_requests(self) -> list[str]:
        return list(self._rates)

    def global_rate(self) -> float:
        total = self._kept + self._refused
        return (self._kept + 0.5) / (total + 1.0)

    # -- the cost model ------------------------------------------------------------------
    def cost_ratio(self, batch_size: int) -> float:
        """c: the time of one more draft token over the time per token of the step without
        drafts, at this batch size."""
        fit = self._fit(batch_size)
        if fit is None:
            return PRIOR_COST
        t0, b = fit
        return max(0.0, b * batch_size / t0) if t0 > 0 else PRIOR_COST

    def _fit(self, batch_size: int) -> tuple[float, float] | None:
        if batch_size in self._fits:
            return self._fits[batch_size]
        samples = self._samples.get(batch_size)
        if not samples or len(samples) < MIN_SAMPLES:
            return None
        d = np.array([s[0] for s in samples], dtype=np.float64)
        t = np.array([s[1] for s in samples], dtype=np.float64)
        t = np.minimum(t, np.median(t) * 3)  # a step stalled by another process says nothing
        drafted = int(np.count_nonzero(d))
        if min(drafted, len(d) - drafted) >= MIN_SAMPLES:  # steps with and without drafts
            b, t0 = np.polyfit(d, t, 1)
            b = max(float(b), 0.0)
            t0 = float(t0)
        else:
            b = self._prior_slope(batch_size, float(t.mean()))
            t0 = float(t.mean()) - b * float(d[0])
        fit = (max(t0, 1e-6), b)
        self._fits[batch_size] = fit
        return fit

    def _prior_slope(self, batch_size: int, mean_t: float) -> float:
        """b where draft counts never varied at this batch size: the cost of one more sequence
        (t0's slope over the batch sizes measured with no drafts), else PRIOR_COST's share."""
        points = [
            (size, float(np.mean([s[1] for s in samples])))
            for size, samples in self._samples.items()
            if size != batch_size and len(samples) >= MIN_SAMPLES and all(s[0] == 0 for s in samples)
        ]
        if points:
            size, t = max(points, key=lambda p: abs(p[0] - batch_size))
            slope = (mean_t - t) / (batch_size - size)
            if slope > 0:
                return slope
        return PRIOR_COST * mean_t / batch_size

    # -- the choice ----------------------------------------------------------------------
    def num_drafts(self, req_id: str, batch_size: int, may_probe: bool = True) -> int:
        """How many drafts this request may verify next step (0: do not draft). A request due
        for a probe while `may_probe` is false stays due (it probes on a later step)."""
        c = self.cost_ratio(batch_size)
        self.stats.cost_ratio = c
        rate = self._rates.get(req_id)
        if rate is None:
            rate = self._rates[req_id] = _Rate(0.0, 0.0)
        self.probed = False
        alpha = rate.alpha(self.global_rate())
        p = rate.yield_rate()
        # Draft i gains p * alpha^i (the drafter drafts, and the first i drafts are kept).
        if c <= 0.0:
            k = self.max_tokens
        elif p * alpha <= c:
            k = 0
        elif alpha >= 1.0:
            k = self.max_tokens
        else:
            k = min(self.max_tokens, math.ceil(math.log(c / p) / math.log(alpha)) - 1)
        if k > 0:
            rate.steps_at_zero = 0
            return k
        rate.steps_at_zero += 1
        if may_probe and c < 1.0 and rate.steps_at_zero >= round(PROBE_STEPS / (1.0 - c)):
            rate.steps_at_zero = 0
            self.probed = True
            return 1
        return 0

    def proven(self, req_id: str) -> bool:
        """Whether a draft of this request was ever kept."""
        rate = self._rates.get(req_id)
        return rate is not None and rate.ever_kept

    def record_choice(self, num_drafts: int) -> None:
        """The drafter's actual proposal length for a request given a budget (for metrics)."""
        if num_drafts:
            self.stats.requests_drafted += 1
        else:
            self.stats.requests_skipped += 1
