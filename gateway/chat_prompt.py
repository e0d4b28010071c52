"""From chat messages and vLLM's chat-template fields to a prompt: the messages as a chat template
takes them, the request's fields as ``ChatOptions`` (a request's own template only with
``--trust-request-chat-template``, as vLLM), rendered and tokenized by the engine client.

Every failure is a 400 naming the field: a message the template cannot take, a refused option
(``engine.client.chat_options``), a model with no chat template (vLLM's message), an untrusted
request template, a template that fails on these messages (its syntax, or what it raises).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, Protocol

from shoal.engine.client.chat_options import ChatOptions
from shoal.engine.client.interface import EngineClientInterface, RequestValidationError
from shoal.gateway.errors import bad_request
from shoal.gateway.params import Prompt, check_text_length
from shoal.gateway.request_types import ChatMessage, MessageToolCall

# OpenAI's message roles; "function" is its deprecated form of "tool", accepted as vLLM does.
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer", "function"})
UNTRUSTED_TEMPLATE = (  # vLLM's answer to a request template the server does not trust
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)


class ChatTemplateFields(Protocol):
    """vLLM's chat-template fields of a request (chat completions, /tokenize, the NATS API)."""

    add_generation_prompt: bool
    continue_final_message: bool
    chat_template: str | None
    chat_template_kwargs: dict[str, Any] | None
    documents: list[dict[str, str]] | None


def chat_options(
    request: ChatTemplateFields,
    *,
    trust_request_chat_template: bool,
    tools: list[dict[str, Any]] | None = None,
) -> ChatOptions:
    """The request's fields as ``ChatOptions``; its own template (also as a template kwarg, as
    vLLM checks) only when the server trusts request templates."""
    kwargs = request.chat_template_kwargs or {}
    brings_template = request.chat_template is not None or kwargs.get("chat_template") is not None
    if brings_template and not trust_request_chat_template:
        raise bad_request(UNTRUSTED_TEMPLATE, param="chat_template")
    return ChatOptions(
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        chat_template=request.chat_template,
        chat_template_kwargs=request.chat_template_kwargs,
        documents=request.documents,
        tools=tools,
    )


def render_chat(
    engine: EngineClientInterface,
    messages: list[ChatMessage],
    options: ChatOptions,
    *,
    add_special_tokens: bool,
) -> Prompt:
    """The prompt ``messages`` render to with ``options``."""
    rendered = chat_messages(messages)
    check_text_length("".join(m["content"] for m in rendered), engine.max_model_len, "messages")
    try:
        ids = list(engine.encode_chat(rendered, options, add_special_tokens=add_special_tokens))
    except RequestValidationError as error:
        raise bad_request(str(error), param=error.param) from None
    except Exception as error:  # the template is user-driven code: any failure is the input's
        param = "messages" if options.chat_template is None else "chat_template"
        raise bad_request(f"cannot apply the chat template: {error}", param=param) from None
    if not ids:
        raise bad_request("messages render to an empty prompt", param="messages")
    return Prompt(ids)


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: text parts joined, a ``name`` kept, an
    assistant's ``tool_calls`` with their arguments as objects (vLLM's: templates write them
    with ``tojson``) and a tool message's ``tool_call_id``."""
    if not messages:
        raise bad_request("messages must not be empty", param="messages")
    out: list[dict[str, Any]] = []
    for message in messages:
        if message.role not in CHAT_ROLES:
            raise bad_request(f"unknown message role {message.role!r}", param="messages")
        rendered: dict[str, Any] = {"role": message.role, "content": message_text(message)}
        if message.name is not None:
            rendered["name"] = message.name
        if message.tool_calls:
            rendered["tool_calls"] = [template_tool_call(call) for call in message.tool_calls]
        if message.tool_call_id is not None:
            rendered["tool_call_id"] = message.tool_call_id
        out.append(rendered)
    return out


def template_tool_call(call: MessageToolCall) -> dict[str, Any]:
    arguments: Any = call.function.arguments
    with contextlib.suppress(ValueError):  # else left as the text it is
        arguments = json.loads(arguments)
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": call.type, "function": function}


def message_text(message: ChatMessage) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    texts: list[str] = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise bad_request("only text content parts are supported", param="messages")
        texts.append(part.text)
    return "".join(texts)
