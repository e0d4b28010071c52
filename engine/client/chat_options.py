"""How one conversation is rendered by a chat template: vLLM's request fields
(``add_generation_prompt``, ``continue_final_message``, ``chat_template``,
``chat_template_kwargs``, ``documents``, plus the request's ``tools``) and vLLM's rules on them.

Refused (``RequestValidationError`` naming the field, a 400 at the gateway):
``continue_final_message`` with ``add_generation_prompt``; ``continue_final_message`` when the
last message is not the assistant's (vLLM's rule for its Mistral tokenizers, kept for every
template: there is no open assistant turn to continue otherwise); ``chat_template_kwargs``
naming ``chat_template`` or ``tokenize``, which vLLM reserves. The request's own fields win
over the same names in ``chat_template_kwargs`` (vLLM's ``merge_kwargs``: a field that is
unset, such as ``documents: null``, leaves the kwarg in place).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shoal.engine.client.errors import RequestValidationError

RESERVED_TEMPLATE_KWARGS = frozenset({"chat_template", "tokenize"})  # vLLM's
ASSISTANT = "assistant"


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """What a chat template renders besides the messages (vLLM's names and defaults)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # the request's own template; None: the served one
    chat_template_kwargs: Mapping[str, Any] | None = None  # more variables for the template
    documents: Sequence[Mapping[str, Any]] | None = None
    tools: Sequence[Mapping[str, Any]] | None = None  # OpenAI's function dicts

    def render_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of transformers' ``apply_chat_template`` besides the messages
        and the template: ``chat_template_kwargs`` under the request's own fields."""
        fields = {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "documents": list(self.documents) if self.documents is not None else None,
            "tools": list(self.tools) if self.tools else None,
        }
        given = {name: value for name, value in fields.items() if value is not None}
        return {**(self.chat_template_kwargs or {}), **given}


def check_chat_options(options: ChatOptions, messages: Sequence[Mapping[str, Any]]) -> None:
    """vLLM's refusals of a rendering (see the module's docstring)."""
    if options.continue_final_message and options.add_generation_prompt:
        raise RequestValidationError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            "continue_final_message",
        )
    if options.continue_final_message and (not messages or messages[-1].get("role") != ASSISTANT):
        raise RequestValidationError(
            "Cannot set `continue_final_message` to True when the last message is not from "
            "the assistant.",
            "continue_final_message",
        )
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(options.chat_template_kwargs or {}))
    if reserved:
        names = ", ".join(repr(name) for name in reserved)
        raise RequestValidationError(
            f"Found unexpected chat template kwargs from request: {{{names}}}",
            "chat_template_kwargs",
        )
