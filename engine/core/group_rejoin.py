"""How the engine cores of a lock-step group agree to rebuild their workers' expert-parallel
group together (fault tolerance on; pure, the wire side is ``bus/messages/lockstep.py``).

The group spans every data-parallel rank's worker, so after a fault every rank must leave it
and join a new one at once, under one epoch. Each engine core that (re)connects its workers
proposes a generation (``propose``): one past the group it is in, past any proposal it heard
and past any generation a peer told it about. A higher proposal heard is adopted; a lower one,
or a peer heard for the first time at this proposal (it may have subscribed after it went
out), is answered with this rank's proposal. The generation is agreed once every rank proposes
it (``take_epoch``: the generation and rank 0's nonce, unique per incarnation). A rank that
gives up (a timeout) withdraws its proposal, so a late peer does not "agree" with it alone.

A rank that is not rebuilding and hears a proposal past its own group learns that the group
is going away under it (``peer_rebuilding``): its engine core takes the fault path, and its
retry proposes too. A proposal at or below its group comes from a rank behind (its engine core
restarted and forgot): it is told the generation, and proposes past it.
"""

from __future__ import annotations

from shoal.bus.messages.lockstep import LockstepRejoin


class GroupRejoin:
    """Rank ``rank`` of ``size``: the generation of its workers' group, and the next one."""

    def __init__(self, rank: int, size: int, nonce: str = "") -> None:
        self.rank = rank
        self.size = size
        self.nonce = nonce  # unique per incarnation of this engine core
        self.joined = 0  # the generation this rank's workers are in (0: none yet)
        self.proposal: int | None = None  # while (re)building
        self._latest: dict[int, int] = {}  # rank -> its latest proposal heard
        self._nonces: dict[int, str] = {rank: nonce}  # rank -> the nonce of that proposal
        self._floor = 1  # the lowest generation this rank may propose
        self._rebuilding_peers: set[int] = set()  # proposed past this rank's group

    @property
    def peer_rebuilding(self) -> bool:
        """A peer rebuilds the group while this rank is not rebuilding."""
        return self.proposal is None and bool(self._rebuilding_peers)

    def propose(self) -> LockstepRejoin:
        """Start (or restart) rebuilding; returns the proposal to publish."""
        self.proposal = max(self.joined + 1, self._floor, *self._latest.values())
        self._latest[self.rank] = self.proposal
        return LockstepRejoin(self.rank, self.proposal, nonce=self.nonce)

    def receive(self, message: LockstepRejoin) -> list[LockstepRejoin]:
        """A peer's message; returns what to publish in answer, if anything."""
        if message.rank == self.rank:
            return []
        if not 0 <= message.rank < self.size:
            raise ValueError(f"rejoin message from rank {message.rank} of {self.size}")
        if message.withdrawn:
            if self._latest.get(message.rank) == message.generation:
                del self._latest[message.rank]
            return []
        if not message.proposing:  # a peer's group is past what this rank knew ...
            if self.proposal == message.generation == self._latest.get(message.rank):
                return []  # ... unless it agreed this very generation with us
            self._floor = max(self._floor, message.generation + 1)
            if self.proposal is not None and self.proposal < self._floor:
                return [self.propose()]
            return []
        previous = self._latest.get(message.rank)
        self._latest[message.rank] = message.generation
        self._nonces[message.rank] = message.nonce
        if self.proposal is None:
            if message.generation > self.joined:
                self._rebuilding_peers.add(message.rank)
                return []
            return [LockstepRejoin(self.rank, self.joined, proposing=False)]  # it is behind
        if message.generation > self.proposal:
            return [self.propose()]  # adopt the higher one
        if message.generation < self.proposal or previous != self.proposal:
            return [LockstepRejoin(self.rank, self.proposal, nonce=self.nonce)]
        return []

    def take_epoch(self) -> str | None:
        """The agreed group's epoch once every rank proposed the same generation (then it is
        joined), else None: the generation and rank 0's nonce, so a deployment whose engine
        cores all restarted does not meet under an earlier run's epoch."""
        if self.proposal is None:
            return None
        if any(self._latest.get(r) != self.proposal for r in range(self.size)):
            return None
        self.joined, self.proposal = self.proposal, None
        self._rebuilding_peers.clear()
        return f"{self.joined}-{self._nonces.get(0, '')}"

    def abandon(self) -> LockstepRejoin | None:
        """Stop rebuilding (a timeout); returns the withdrawal to publish (peers forget the
        proposal). The next ``propose`` starts again."""
        if self.proposal is None:
            return None
        withdrawn = LockstepRejoin(self.rank, self.proposal, nonce=self.nonce, withdrawn=True)
        self._latest.pop(self.rank, None)
        self.proposal = None
        return withdrawn
