"""Encoders and decoders built once per message type: msgpack for the internal wire, JSON for
the public API. A payload that does not decode raises ``DecodeError`` with a readable reason."""

from __future__ import annotations

from typing import Any, Generic, TypeVar, overload

import msgspec

T = TypeVar("T")


class DecodeError(ValueError):
    """A payload that is not a valid message of the expected type."""

    def __init__(self, type_name: str, reason: str) -> None:
        super().__init__(f"cannot decode {type_name}: {reason}")
        self.type_name = type_name
        self.reason = reason


def _type_name(type_: Any) -> str:
    return getattr(type_, "__name__", None) or str(type_)


class Codec(Generic[T]):
    """msgpack codec for one struct or tagged union, e.g. ``Codec(EngineInbound)``."""

    _format: Any = msgspec.msgpack

    @overload
    def __init__(self: Codec[T], type_: type[T]) -> None: ...
    @overload
    def __init__(self: Codec[Any], type_: Any) -> None: ...
    def __init__(self, type_: Any) -> None:
        self.type = type_
        self.type_name = _type_name(type_)
        self._encoder = self._format.Encoder()
        self._decoder = self._format.Decoder(type_)

    def encode(self, obj: T) -> bytes:
        data: bytes = self._encoder.encode(obj)
        return data

    def decode(self, data: bytes | bytearray | memoryview) -> T:
        try:
            obj: T = self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
            raise DecodeError(self.type_name, str(exc)) from None
        return obj


_ANY_ENCODER = msgspec.msgpack.Encoder()


def encode(obj: Any) -> bytes:
    """msgpack-encode any struct (replies whose type the sender knows)."""
    return _ANY_ENCODER.encode(obj)
