"""Where the engine client's requests in flight live (``RequestPlacements``): each one's
collector (held from the moment it is added until it ends) and, while it is on one, the engine
core it was sent to with that engine core's epoch at the time. A request parked for resumption
keeps its collector but has no engine core. Pure bookkeeping: no I/O, no policy.
"""

from __future__ import annotations

from shoal.engine.client.collector import RequestOutputCollector


class RequestPlacements:
    """Request id → collector, and request id → (engine id, epoch when sent)."""

    def __init__(self) -> None:
        self._collectors: dict[str, RequestOutputCollector] = {}
        self._engine_of: dict[str, str] = {}
        self._epoch_of: dict[str, int] = {}

    def __contains__(self, request_id: object) -> bool:
        """Whether a request is in flight (it has a collector)."""
        return request_id in self._collectors

    def track(self, request_id: str, collector: RequestOutputCollector) -> None:
        """Hold a new request's collector (not yet placed on an engine core)."""
        self._collectors[request_id] = collector

    def collector(self, request_id: str) -> RequestOutputCollector | None:
        return self._collectors.get(request_id)

    def request_ids(self) -> list[str]:
        """The requests in flight, placed or not."""
        return list(self._collectors)

    def place(self, request_id: str, engine_id: str, epoch: int) -> None:
        """The request goes to ``engine_id``, whose epoch is ``epoch`` now."""
        self._engine_of[request_id] = engine_id
        self._epoch_of[request_id] = epoch

    def engine_of(self, request_id: str) -> str | None:
        return self._engine_of.get(request_id)

    def placed(self) -> dict[str, str]:
        """A snapshot: request id → engine id, for the requests on an engine core."""
        return dict(self._engine_of)

    def on_engine(self, engine_id: str, *, sent_before: int | None = None) -> list[str]:
        """The requests on ``engine_id``; with ``sent_before``, only those sent to it in an
        earlier epoch than that."""
        return [
            request_id
            for request_id, engine in self._engine_of.items()
            if engine == engine_id
            and (sent_before is None or self._epoch_of[request_id] < sent_before)
        ]

    def detach(self, request_id: str) -> str | None:
        """Take the request off its engine core (it keeps its collector); that engine's id."""
        self._epoch_of.pop(request_id, None)
        return self._engine_of.pop(request_id, None)

    def untrack(self, request_id: str) -> tuple[RequestOutputCollector | None, str | None]:
        """Forget a request that ended: its collector and engine core (both returned)."""
        return self._collectors.pop(request_id, None), self.detach(request_id)
