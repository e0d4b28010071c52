"""Engine core ↔ engine core: the rounds of a lock-step group (expert parallelism).

With ``enable_expert_parallel`` every MoE layer of every step is a collective across the
workers of all data-parallel ranks, so the engine cores must send their workers the same number
of steps. Before each step every engine core of the group publishes a ``LockstepReport`` for
its next round on ``subjects.lockstep()`` (the tokens it scheduled, 0 for none) and waits for
every rank's report of that round; the round runs when any rank has tokens (a rank with none
sends its workers a dummy step), and nobody steps when all report none.

A rank that receives a report for a round it has already passed (the sender restarted) answers
with a ``LockstepHint`` naming its next round, and its own pending report again (the restarted
rank may have missed it); the sender moves its pending report there. A rank that gives up on a
round (a timeout) publishes ``LockstepWithdraw``, so that no peer runs the round on its report.
"""

from __future__ import annotations

import msgspec


class LockstepReport(msgspec.Struct, tag="lockstep_report", array_like=True, frozen=True):
    """Rank ``rank``'s report for ``round``: ``num_tokens`` scheduled (0: nothing to run)."""

    rank: int
    round: int
    num_tokens: int


class LockstepHint(msgspec.Struct, tag="lockstep_hint", array_like=True, frozen=True):
    """Rank ``rank`` is at ``next_round`` (sent to a rank that reported an earlier round)."""

    rank: int
    next_round: int


class LockstepWithdraw(msgspec.Struct, tag="lockstep_withdraw", array_like=True, frozen=True):
    """Rank ``rank`` gave up waiting for ``round`` (a timeout): forget its report of it."""

    rank: int
    round: int


class LockstepRejoin(msgspec.Struct, tag="lockstep_rejoin", array_like=True, frozen=True):
    """Rank ``rank`` (re)builds the workers' expert-parallel group as ``generation`` (fault
    tolerance): every rank must rebuild with it (``engine/core/group_rejoin.py``). Not
    ``proposing``: only telling a rank behind that this one's group is ``generation``."""

    rank: int
    generation: int
    proposing: bool = True
    nonce: str = ""  # the proposer's incarnation: keys the group's rendezvous with generation
    withdrawn: bool = False  # the proposer gave up waiting (a timeout): forget its proposal


LockstepMessage = LockstepReport | LockstepHint | LockstepWithdraw | LockstepRejoin
