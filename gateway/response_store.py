"""Stored responses (``store: true``) in the deployment's JetStream key-value bucket, so that any
gateway can answer ``GET /v1/responses/{id}`` and continue a conversation from a
``previous_response_id`` (vLLM keeps them in one process's memory). A record is the response
object and the conversation up to it, as chat messages. Without a bus (a gateway in a test), the
records live in this process."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from shoal.bus.buckets import KvBucket
from shoal.gateway.request_types import ChatMessage
from shoal.gateway.responses_types import Response

OpenBucket = Callable[[], Awaitable[KvBucket]]


class StoredResponse(msgspec.Struct):
    response: Response
    messages: list[ChatMessage]  # the conversation through this response's output


class ResponseStore:
    def __init__(self, open_bucket: OpenBucket | None = None) -> None:
        self._open_bucket = open_bucket
        self._bucket: KvBucket | None = None
        self._local: dict[str, bytes] = {}

    async def _kv(self) -> KvBucket | None:
        if self._open_bucket is None:
            return None
        if self._bucket is None:
            self._bucket = await self._open_bucket()
        return self._bucket

    async def put(self, record: StoredResponse) -> None:
        data = msgspec.json.encode(record)
        bucket = await self._kv()
        if bucket is None:
            self._local[record.response.id] = data
        else:
            await bucket.put(record.response.id, data)

    async def get(self, response_id: str) -> StoredResponse | None:
        if not _valid_key(response_id):
            return None
        bucket = await self._kv()
        data = self._local.get(response_id) if bucket is None else await bucket.get(response_id)
        return None if data is None else msgspec.json.decode(data, type=StoredResponse)


def _valid_key(key: Any) -> bool:
    return isinstance(key, str) and key.startswith("resp_") and key[5:].isalnum()
