"""Acceptance-driven K (shoal's own, beyond vLLM's batch-size table): the number of drafts per
step follows the acceptance the engine core observes.

Drafts are accepted in a leading run: a request that verified ``n`` drafts and accepted ``a`` saw
``a`` acceptances and, when ``a < n``, one rejection. The per-draft acceptance probability is
estimated as ``accepted / (accepted + rejections)`` (the geometric MLE; ``accepted / drafted``
would understate it, since drafts after a rejection are never judged), smoothed by an exponential
moving average over steps. A step weighs by its evidence: one that judged ``evidence_unit`` drafts
or fewer counts as one observation, a bigger one (a large batch) as ``judged / evidence_unit``
observations, so 64 requests rejecting their drafts move the estimate (and wear out the patience)
as far as a dozen small steps would. A draft at position ``j`` pays off when it is likely to be
reached and accepted (``alpha ** j >= worth``), so the target is the largest such ``j``, bounded by
the table's K for the batch size. K moves to the target only after the target has pointed the same
way for ``patience`` observed steps in a row (hysteresis: one noisy step does not flip K); it then
goes straight there, so a workload that turns takes ``patience`` steps to follow, not ``patience``
per unit of K. At K = 0 nothing is drafted, so nothing is observed: a K = 1 probe every
``probe_every`` steps keeps the estimate fresh; each probe that leaves K at 0 doubles the wait
before the next (up to ``max_probe_every``), so a workload that never accepts pays for few probes,
and K leaving 0 resets it. Drafts already proposed when K falls are verified only up to the new
K (``num_worth_verifying``): the step after a drop does not pay for the old K's drafts. A padded
draft (async scheduling: the worker had fewer drafts than the K placeholders scheduled) counts as
rejected: its slot cost a forward position all the same, so K should fall when drafts are
missing as much as when they are wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class AcceptanceController:
    """K from observed acceptance (see the module docstring); ``choose(bound)`` each step."""

    max_k: int
    smoothing: float = 0.2  # weight of the newest step in the moving average
    worth: float = 0.35  # a draft position is worth it when alpha ** position >= worth
    patience: int = 3  # observed steps pointing the same way before K moves
    probe_every: int = 16  # steps between K = 1 probes when K has just reached 0
    max_probe_every: int = 128  # the longest wait between probes (it doubles per failed probe)
    evidence_unit: int = 4  # judged drafts that count as one observation
    alpha: float = 0.7  # the estimated per-draft acceptance probability (prior)
    k: int = 0
    _streak: float = 0.0  # observations in a row whose target is above (+) or below (-) K
    _steps_at_zero: int = 0
    _probe_wait: int = 0  # steps between probes now
    _probing: bool = False  # a probe was sent and its verdict has not been observed

    def __post_init__(self) -> None:
        self.k = self.max_k
        self._probe_wait = self.probe_every

    def observe(self, num_accepted: int, num_rejections: int) -> None:
        """One step's totals over its requests: accepted drafts and requests with a rejection."""
        judged = num_accepted + num_rejections
        if judged == 0:
            return
        rate = num_accepted / judged
        weight = max(1.0, judged / self.evidence_unit)
        self.alpha += (1.0 - (1.0 - self.smoothing) ** weight) * (rate - self.alpha)
        target = self.target()
        if target == self.k:
            self._streak = 0
            if target == 0 and self._probing:  # the probe found nothing worth drafting
                self._probe_wait = min(2 * self._probe_wait, self.max_probe_every)
            self._probing = False
            return
        self._probing = False
        direction = 1 if target > self.k else -1
        gained = direction * weight
        self._streak = self._streak + gained if self._streak * direction >= 0 else gained
        if abs(self._streak) >= self.patience:
            self.k = target
            self._streak = 0
            self._probe_wait = self.probe_every

    def target(self) -> int:
        """The largest position j with alpha ** j >= worth (0 when even the first is not)."""
        if self.alpha >= 1.0:
            return self.max_k
        if self.alpha <= 0.0:
            return 0
        return max(0, min(self.max_k, math.floor(math.log(self.worth) / math.log(self.alpha))))

    def num_worth_verifying(self) -> int:
        """Drafts worth verifying now, whatever K they were proposed with: K, or 1 while a
        probe's drafts await their verdict. Drafts proposed before K fell are not verified."""
        return max(self.k, 1) if self._probing else self.k

    def choose(self, bound: int) -> int:
        """K for the next step, at most ``bound`` (the table's K for the batch size)."""
        k = min(self.k, bound)
        if k > 0 or bound == 0:
            self._steps_at_zero = 0
            return k
        self._steps_at_zero += 1
        if self._steps_at_zero >= self._probe_wait:
            self._steps_at_zero = 0
            self._probing = True
            return 1
        return 0
