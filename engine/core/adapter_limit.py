"""The scheduler's LoRA bookkeeping. Its rule (vLLM's): the running requests use at most
``max_loras`` distinct adapters, the slots each worker holds; a waiting request whose adapter
would be one too many is passed over for this step (the requests behind it may go) and keeps
its place in the queue. And what it reports: the adapters running, waiting and resident."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

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


class ResidentAdapters:
    """The adapters a worker's slots hold, as the engine core can tell from its own steps: each
    step's adapters are put in slots, least recently used out (what the worker's slot table does
    with the same steps). Routing prefers an engine core whose workers hold a request's
    adapter."""

    __slots__ = ("_max", "_names")

    def __init__(self, max_loras: int) -> None:
        self._max = max_loras
        self._names: dict[str, None] = {}  # least recently used first

    def note_step(self, names: Iterable[str]) -> None:
        for name in dict.fromkeys(names):
            self._names.pop(name, None)
            self._names[name] = None
        while len(self._names) > self._max:
            del self._names[next(iter(self._names))]

    @property
    def names(self) -> list[str]:
        return list(self._names)


@dataclass(frozen=True, slots=True)
class LoRAReport:
    """The adapters of an engine core's requests, for its stats (vLLM's lora_requests_info)."""

    running: list[str]
    waiting: list[str]
    resident: list[str]
    max_loras: int


def adapter_names(requests: Iterable[Request]) -> list[str]:
    """The distinct adapters of ``requests``, sorted."""
    return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})
