"""shoal: an LLM inference and serving engine built of actors on a message bus.

The installed ``shoal`` namespace: each top-level folder of the repository is a subpackage
(``shoal.bus``, ``shoal.engine``, ``shoal.workers``, ``shoal.kernels``, ``shoal.tiers``,
``shoal.gateway``, ``shoal.deploy``, ``shoal.tracing``); this folder holds only links to them.
The offline API is one import away, as in vLLM::

    from shoal import LLM, SamplingParams
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shoal.bus.messages.lora import LoRARequest
from shoal.bus.messages.sampling import OutputKind, SamplingParams

if TYPE_CHECKING:
    from shoal.deploy.llm import LLM

__all__ = ["LLM", "LoRARequest", "OutputKind", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":  # imported lazily: it pulls in the engine client and tokenizers
        from shoal.deploy.llm import LLM

        return LLM
    raise AttributeError(f"module 'shoal' has no attribute {name!r}")
