"""The rounds of one engine core in a lock-step group (pure; the wire side is
``bus/messages/lockstep.py``, the shell ``engine/actor/lockstep_link.py``).

Every rank reports each round once (``report``) and takes the round's ``RoundOutcome`` once all
``size`` reports are in (``take_outcome``). Reports arrive in order per sender, so a peer can be
at most one round ahead of a rank that has not finished the round (it cannot finish a round
without this rank's report): a report one round ahead is kept for later. A report two or more
rounds ahead means this rank is behind (it restarted): it moves to that round. A report for a
round this rank has passed means the sender is behind: ``receive`` answers it with a hint, and
a rank hinted past its pending round moves its report there (its tokens do not depend on the
round's number).
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.bus.messages.lockstep import (
    LockstepHint,
    LockstepMessage,
    LockstepReport,
    LockstepWithdraw,
)


@dataclass(frozen=True)
class RoundOutcome:
    """A finished round: every rank's scheduled tokens (index = rank)."""

    round: int
    num_tokens: tuple[int, ...]

    @property
    def runs(self) -> bool:
        """Whether every rank steps this round (some rank has tokens)."""
        return any(self.num_tokens)


class Lockstep:
    """Rank ``rank`` of a group of ``size`` engine cores."""

    def __init__(self, rank: int, size: int) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"bad lock-step rank {rank} of size {size}")
        self.rank = rank
        self.size = size
        self.next_round = 0
        self.pending: LockstepReport | None = None  # this rank's report, until its round ends
        self._reports: dict[int, dict[int, int]] = {}  # round -> rank -> tokens

    @property
    def peer_waiting(self) -> bool:
        """A peer reported a round this rank has not reported yet: it must join that round."""
        if self.pending is not None:
            return False
        return any(
            r >= self.next_round and any(rank != self.rank for rank in reports)
            for r, reports in self._reports.items()
        )

    def report(self, num_tokens: int) -> LockstepReport:
        """This rank's report for its next round (to publish); one per round."""
        if num_tokens < 0:
            raise ValueError(f"negative token count {num_tokens}")
        if self.pending is not None:
            raise RuntimeError(f"round {self.pending.round} is already reported")
        self.pending = LockstepReport(self.rank, self.next_round, num_tokens)
        self._record(self.pending)
        return self.pending

    def receive(self, message: LockstepMessage) -> list[LockstepMessage]:
        """A peer's message; returns what to publish in answer: to a rank behind, a hint and
        this rank's pending report; when this rank is behind, its report moved forward."""
        if message.rank == self.rank:
            return []  # our own message, echoed by the bus
        if not 0 <= message.rank < self.size:
            raise ValueError(f"lock-step message from rank {message.rank} of {self.size}")
        match message:
            case LockstepHint(next_round=ahead):
                return self._move_to(ahead)
            case LockstepWithdraw():
                self._forget(message.round, message.rank)
                return []
            case LockstepReport():
                if message.round < self.next_round:
                    hint = LockstepHint(self.rank, self.next_round)
                    return [hint] if self.pending is None else [hint, self.pending]
                self._record(message)
                if message.round > self.next_round + 1:
                    return self._move_to(message.round)
                return []
        raise TypeError(f"not a round message: {message!r}")  # rejoins: group_rejoin.py

    def take_outcome(self) -> RoundOutcome | None:
        """The pending round's outcome once every rank reported it (then the next round
        begins), else None."""
        if self.pending is None:
            return None
        reports = self._reports.get(self.pending.round, {})
        if len(reports) < self.size:
            return None
        outcome = RoundOutcome(self.pending.round, tuple(reports[r] for r in range(self.size)))
        del self._reports[self.pending.round]
        self.next_round = self.pending.round + 1
        self.pending = None
        return outcome

    def abandon(self) -> LockstepWithdraw | None:
        """Withdraw the pending report (after a timeout); returns the withdrawal to publish.
        The next report is for the same round (peers still waiting take it; peers that
        finished it answer with a hint)."""
        if self.pending is None:
            return None
        withdrawn = LockstepWithdraw(self.rank, self.pending.round)
        self._forget(self.pending.round, self.rank)
        self.pending = None
        return withdrawn

    def _forget(self, round_index: int, rank: int) -> None:
        reports = self._reports.get(round_index)
        if reports is not None:
            reports.pop(rank, None)
            if not reports:
                del self._reports[round_index]

    def _record(self, report: LockstepReport) -> None:
        self._reports.setdefault(report.round, {})[report.rank] = report.num_tokens

    def _move_to(self, round_index: int) -> list[LockstepMessage]:
        """Jump ahead to ``round_index`` (this rank was behind); the pending report moves there
        and is returned for publishing again."""
        if round_index <= self.next_round:
            return []
        for stale in [r for r in self._reports if r < round_index]:
            del self._reports[stale]
        self.next_round = round_index
        if self.pending is None:
            return []
        self.pending = LockstepReport(self.rank, round_index, self.pending.num_tokens)
        self._record(self.pending)
        return [self.pending]
