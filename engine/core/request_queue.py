"""Waiting queues: FCFS (a deque) and priority (a heap on (priority, arrival, id)).

Both put a preempted request back ahead of new arrivals: FCFS prepends it; the priority heap
orders it by its own (priority, arrival) key, which is older than any later arrival's. A request
that left the queue for a while (parked during a KV lookup) is put back where its arrival places
it (``reinsert``), so requests answered together keep their order.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from shoal.engine.core.request import Request


class RequestQueue(Protocol):
    def add(self, request: Request) -> None: ...
    def prepend(self, request: Request) -> None: ...
    def reinsert(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> bool: ...
    def __len__(self) -> int: ...
    def __bool__(self) -> bool: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    """Arrival order; preempted requests go to the front."""

    __slots__ = ("_queue",)

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def reinsert(self, request: Request) -> None:
        """Before the first request that arrived later: FCFS as if it had never left (even
        ahead of a request preempted meanwhile that arrived after it)."""
        for index, queued in enumerate(self._queue):
            if queued.arrival_time > request.arrival_time:
                self._queue.insert(index, request)
                return
        self._queue.append(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> bool:
        try:
            self._queue.remove(request)
        except ValueError:
            return False
        return True

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """Lowest (priority, arrival_time, request_id) first."""

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def prepend(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def reinsert(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def peek(self) -> Request:
        return self._heap[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)

    def remove(self, request: Request) -> bool:
        try:
            self._heap.remove(request)
        except ValueError:
            return False
        heapq.heapify(self._heap)
        return True

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))


def make_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"policy must be fcfs or priority, got {policy!r}")
