"""The engine: request model, scheduler, KV cache manager, the engine core actor, the engine
client and the offline API. ``from engine import LLM, SamplingParams`` as in vLLM."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bus.messages.sampling import OutputKind, SamplingParams

if TYPE_CHECKING:
    from engine.llm import LLM

__all__ = ["LLM", "OutputKind", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":  # imported lazily: it pulls in the client and tokenizers
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)
