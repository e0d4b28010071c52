"""The engine client's interface, as the gateway and the offline API see it.

``AsyncEngineClient`` (``engine_client.py``) implements it over the bus; tests may implement it
with a fake. Nothing here talks to the bus itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

from shoal.bus.messages.fault import FaultToleranceRequest, FaultToleranceResult
from shoal.bus.messages.lora import LoRARequest
from shoal.bus.messages.sampling import SamplingParams
from shoal.engine.client.errors import EngineUnavailableError, RequestValidationError
from shoal.engine.client.fault_tolerance import FtStatus
from shoal.engine.client.outputs import RequestOutput

__all__ = ["EngineClientInterface", "EngineUnavailableError", "RequestValidationError"]

if TYPE_CHECKING:
    from shoal.engine.client.chat_options import ChatOptions
    from shoal.engine.client.generation_defaults import GenerationDefaults
    from shoal.engine.client.vocabulary import Vocabulary


class FaultToleranceApi(Protocol):
    """The engine cores' fault-tolerance status and recovery commands (an engine client's
    ``fault_tolerance`` attribute, where it has one: ``fault_tolerance.FaultTolerance``)."""

    listeners: list[Callable[[str, str], None]]  # (engine id, status name) on each change

    def status(self) -> FtStatus: ...

    async def apply(self, request: FaultToleranceRequest) -> dict[str, FaultToleranceResult]:
        """Send ``request`` to every known engine core; each one's result."""
        ...


class EngineClientInterface(Protocol):
    """What a front end needs from the engine."""

    @property
    def model_name(self) -> str:
        """The served model name (what ``/v1/models`` lists)."""
        ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def tokenizer(self) -> Any:
        """A ``transformers`` tokenizer (encode, decode, apply_chat_template)."""
        ...

    @property
    def vocabulary(self) -> Vocabulary:
        """The token ids the model takes in a prompt and samples."""
        ...

    @property
    def generation_defaults(self) -> GenerationDefaults:
        """The sampling defaults of requests that leave fields unset (``--generation-config``)."""
        ...

    async def embed(
        self, prompt: str | list[int], request_id: str, *, lora_request: LoRARequest | None = None
    ) -> RequestOutput:
        """The prompt's embedding (``RequestOutput.pooled``), pooled as the model's pooling
        config says; raises as ``generate`` does."""
        ...

    def is_ready(self) -> bool:
        """True while at least one engine core is ready to take requests."""
        ...

    def accepts_requests(self) -> bool:
        """True while a new request is taken: an engine core is ready, or the request would
        wait for one (every known engine core is down for now and requests resume)."""
        ...

    def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until it finishes (with ``lora_request``'s adapter).

        Raises ``RequestValidationError`` (bad prompt), ``EngineUnavailableError`` (503).
        Closing the iterator early (client gone) aborts the request in its engine core.
        """
        ...

    async def abort(self, request_id: str) -> None: ...

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        options: ChatOptions | None = None,
        *,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Apply the chat template (the request's, else the served one) with ``options`` (vLLM's
        chat fields and the request's tools) and tokenize (with the tokenizer's special tokens
        only if ``add_special_tokens``: the template supplies any BOS itself). A refused option
        or a model without a template: ``RequestValidationError``; a template that fails on
        these messages raises what the template raised."""
        ...
