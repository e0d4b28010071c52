"""The engine client's errors, as the gateway maps them: no engine core can take a request
(HTTP 503), and a request invalid for this model (HTTP 400, naming the field)."""


class EngineUnavailableError(RuntimeError):
    """No engine core can take the request (none ready, or every queue full): HTTP 503."""


class RequestValidationError(ValueError):
    """The request is invalid for this model (e.g. the prompt is longer than max_model_len)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
