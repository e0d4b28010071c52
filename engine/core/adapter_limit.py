"""The scheduler's LoRA rule (vLLM's): the running requests use at most ``max_loras`` distinct
adapters, the slots each worker holds. A waiting request whose adapter would be one too many is
passed over for this step (the requests behind it may go) and keeps its place in the queue."""

from __future__ import annotations

from collections.abc import Iterable

from shoal.engine.core.request import Request
from shoal.engine.core.request_queue import RequestQueue


class AdapterLimit:
    __slots__ = ("_adapters", "_max", "_skipped")

    def __init__(self, max_loras: int, running: Iterable[Request]) -> None:
        """``max_loras`` 0: no adapters served, no rule."""
        self._max = max_loras
        self._adapters = {
            r.lora_request.lora_int_id for r in running if r.lora_request is not None
        } if max_loras else set()  # fmt: skip
        self._skipped: list[Request] = []

    def admits(self, request: Request) -> bool:
        lora = request.lora_request
        if not self._max or lora is None or lora.lora_int_id in self._adapters:
            return True
        return len(self._adapters) < self._max

    def admitted(self, request: Request) -> None:
        if self._max and request.lora_request is not None:
            self._adapters.add(request.lora_request.lora_int_id)

    def skip(self, request: Request) -> None:
        self._skipped.append(request)

    def requeue(self, waiting: RequestQueue) -> None:
        """The passed-over requests back at the front of the queue, in their order."""
        for request in reversed(self._skipped):
            waiting.prepend(request)
        self._skipped.clear()
