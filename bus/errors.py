"""The errors the bus raises: ``BusError`` and its kinds (timeouts, no responders, a closed bus,
a lost connection, a remote error in a streamed reply, a payload that did not reassemble)."""

from __future__ import annotations


class BusError(Exception):
    """Base of every error the bus raises."""


class BusTimeoutError(BusError, TimeoutError):
    """No reply (or no next stream message) arrived within the timeout."""


class NoRespondersError(BusError):
    """Nobody subscribes to the subject a request was sent to."""


class BusClosedError(BusError):
    """The bus is closed (or not connected yet)."""


class ConnectionLostError(BusError):
    """The connection dropped while a request waited for its reply: it may or may not have been
    handled, and its reply will not come."""


class RemoteError(BusError):
    """A responder ended a streamed reply with an error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class PayloadIntegrityError(BusError):
    """A chunked payload could not be reassembled intact (missing chunk, bad digest)."""
