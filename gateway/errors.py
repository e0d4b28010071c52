"""OpenAI-shaped errors: the one exception every handler raises and the body it becomes.

Every error answer, HTTP or NATS, is ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import logging
import re

import msgspec

log = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    501: "server_error",
    503: "service_unavailable_error",
}


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class ApiError(Exception):
    """An error to answer with: HTTP ``status``, OpenAI ``code`` and the ``param`` at fault."""

    def __init__(
        self, status: int, message: str, *, code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    def to_response(self) -> ErrorResponse:
        error_type = _TYPE_BY_STATUS.get(self.status, "invalid_request_error")
        return ErrorResponse(ErrorInfo(self.message, error_type, self.param, self.code))

    def to_json(self) -> bytes:
        return msgspec.json.encode(self.to_response())


def bad_request(message: str, *, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code=code, param=param)


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, code="engine_unavailable")


def internal_error(error: BaseException) -> ApiError:
    """A bug in the gateway: logged with its traceback, answered without internals."""
    log.error("internal error", exc_info=error)
    return ApiError(500, "internal server error", code="internal_error")


_PATH_FIELD = re.compile(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)")
_PATH = re.compile(r"at `\$\.([^`]+)`")
_WRONG_TYPE = re.compile(r"Expected `[^`]+`, got `")
_MISSING_FIELD = re.compile(r"missing required field `([A-Za-z_][A-Za-z0-9_]*)`")


def from_decode_error(error: msgspec.DecodeError, wire_format: str = "json") -> ApiError:
    """A msgspec decode failure as a 400: a malformed body (code ``invalid_<format>``), or a
    wrong type/value at a path."""
    text = str(error)
    if not isinstance(error, msgspec.ValidationError):
        return bad_request(f"Invalid {wire_format} body: {text}", code=f"invalid_{wire_format}")
    missing = _MISSING_FIELD.search(text)
    if missing:  # OpenAI's param: the missing field's whole path (``messages[0].role``)
        under = _PATH.search(text)
        param = f"{under.group(1)}.{missing.group(1)}" if under else missing.group(1)
        return bad_request(text, param=param, code="missing_required_parameter")
    match = _PATH_FIELD.search(text)
    param = match.group(1) if match else None
    code = "invalid_type" if _WRONG_TYPE.match(text) else "invalid_value"
    return bad_request(text, param=param, code=code)


def from_value_error(error: ValueError, *, rename: dict[str, str] | None = None) -> ApiError:
    """A ``SamplingParams`` failure (``"<field> <reason>"``) as a 400 naming the field."""
    text = str(error)
    field = text.split(" ", 1)[0] if text else None
    param = (rename or {}).get(field or "", field)
    if param and field and param != field:
        text = param + text[len(field) :]
    return bad_request(text, param=param)
