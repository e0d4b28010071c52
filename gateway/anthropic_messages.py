"""``POST /v1/messages``: Anthropic's Messages API, translated into a chat request (the system
prompt and content blocks into the chat template's messages, tools into function tools,
``tool_choice`` into OpenAI's), run as chat completions run (``chat.prepare_chat``: the same
template, sampling, tool parsing and grammar of forced calls), and answered in Anthropic's
shapes: a message of text and ``tool_use`` blocks, or its stream of named events. Its errors
are Anthropic's error body.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from shoal.engine.client.outputs import CompletionOutput, RequestOutput
from shoal.gateway.anthropic_types import (
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    ContentOut,
    ErrorBody,
    ErrorInfo,
    ImageBlock,
    InputJsonDelta,
    InputMessage,
    Message,
    MessageDelta,
    MessagesRequest,
    MessageStart,
    MessageStop,
    OutputUsage,
    StopDelta,
    TextBlock,
    TextDelta,
    TextOut,
    ThinkingBlock,
    ThinkingDelta,
    ThinkingOut,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseOut,
    Usage,
)
from shoal.gateway.chat import PreparedChat, prepare_chat, tools_error
from shoal.gateway.errors import ApiError, bad_request
from shoal.gateway.events import EventStream, NamedSseStream, write_stream
from shoal.gateway.generation import Generation
from shoal.gateway.reasoning import ReasoningStream, split_reasoning
from shoal.gateway.request_types import (
    CalledFunction,
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    FunctionDefinition,
    MessageToolCall,
    NamedFunction,
    NamedToolChoice,
)
from shoal.gateway.serving import ServingContext, decode_body
from shoal.gateway.tool_parsers.calls import DeltaToolCall, ExtractedToolCalls
from shoal.gateway.tools import CallStream

# Anthropic's error type of each HTTP status (others: api_error)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def error_body(error: ApiError) -> ErrorBody:
    return ErrorBody(ErrorInfo(ERROR_TYPES.get(error.status, "api_error"), error.message))


def error_response(error: ApiError) -> web.Response:
    body = msgspec.json.encode(error_body(error))
    return web.Response(body=body, status=error.status, content_type="application/json")


async def create_message(ctx: ServingContext, request: web.Request) -> web.StreamResponse:
    arrival_time = time.time()
    try:
        body = await decode_body(request, MessagesRequest)
        if not body.stream:
            message = await answer_message(ctx, body, arrival_time)
            return web.Response(body=msgspec.json.encode(message), content_type="application/json")
        events = AnthropicEventStream(request, ctx.sse_keep_alive_s)
        await answer_message(ctx, body, arrival_time, events)
        return events.response
    except ApiError as error:
        return error_response(error)


async def answer_message(
    ctx: ServingContext,
    body: MessagesRequest,
    arrival_time: float,
    events: EventStream | None = None,
) -> Message | None:
    """Run one Messages request (the HTTP and NATS APIs' shared part): streamed into
    ``events`` (None returned), else answered whole."""
    chat = prepare_chat(ctx, chat_request(body))
    ctx.check_ready()
    generation = Generation(
        ctx.engine,
        [chat.prompt],
        [chat.params],
        f"msg_{uuid.uuid4().hex}",
        ctx.metrics,
        arrival_time,
        chat.lora,
    )
    view = MessageView(ctx, chat, generation)
    try:
        async with generation:
            if events is None:
                return await view.complete()
            await write_stream(
                events,
                generation,
                view.add_events,
                add_opening=view.add_start,
                add_closing=view.add_end,
            )
            return None
    except ApiError as error:
        raise tools_error(error, chat.plan) from None


# ----- the request, as a chat request


def chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    messages: list[ChatMessage] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else _text(body.system)
        messages.append(ChatMessage("system", system))
    for message in body.messages:
        messages.extend(_chat_messages(message))
    tool_choice: str | NamedToolChoice | None = None
    parallel = None
    if body.tool_choice is not None:
        choice = body.tool_choice
        if choice.type == "tool":
            if not choice.name:
                raise bad_request("tool_choice of type tool needs a name", param="tool_choice")
            tool_choice = NamedToolChoice(NamedFunction(choice.name))
        else:
            tool_choice = TOOL_CHOICES[choice.type]
        parallel = False if choice.disable_parallel_tool_use else None
    tools = [
        ChatTool(FunctionDefinition(t.name, t.description, t.input_schema))
        for t in body.tools or []
    ]
    if body.max_tokens < 1:
        raise bad_request("max_tokens must be at least 1", param="max_tokens")
    return ChatCompletionRequest(
        model=body.model,
        messages=messages,
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=body.stop_sequences,
        tools=tools or None,
        tool_choice=tool_choice if tools else None,
        parallel_tool_calls=parallel,
        ignore_eos=body.ignore_eos,
        structured_outputs=body.structured_outputs,
    )


def _text(blocks: list[TextBlock]) -> str:
    return "".join(block.text for block in blocks)


def _chat_messages(message: InputMessage) -> list[ChatMessage]:
    """One Anthropic message as chat messages: a user message's tool results become tool
    messages (before its text), an assistant's tool uses its tool calls."""
    if isinstance(message.content, str):
        return [ChatMessage(message.role, message.content)]
    texts: list[str] = []
    results: list[ChatMessage] = []
    calls: list[MessageToolCall] = []
    for block in message.content:
        match block:
            case TextBlock():
                texts.append(block.text)
            case ToolResultBlock():
                results.append(
                    ChatMessage("tool", _result_text(block), tool_call_id=block.tool_use_id)
                )
            case ToolUseBlock():
                arguments = json.dumps(block.input)
                calls.append(MessageToolCall(block.id, CalledFunction(block.name, arguments)))
            case ThinkingBlock():
                continue  # earlier reasoning is not replayed into the prompt
            case _:
                kind = "image" if isinstance(block, ImageBlock) else "document"
                raise bad_request(
                    f"{kind} content blocks are not supported: this model reads text only",
                    param="messages",
                )
    if message.role == "assistant":
        return [ChatMessage("assistant", "".join(texts), tool_calls=calls or None)]
    return results + ([ChatMessage("user", "".join(texts))] if texts or not results else [])


def _result_text(block: ToolResultBlock) -> str:
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    if any(isinstance(part, ImageBlock) for part in block.content):
        raise bad_request("image content in a tool_result is not supported", param="messages")
    return "".join(part.text for part in block.content if isinstance(part, TextBlock))


# ----- the answer


def stop_reason(completion: CompletionOutput | None, called: bool) -> tuple[str, str | None]:
    """Anthropic's stop reason and stop sequence for a finished completion."""
    if called:
        return "tool_use", None
    if completion is not None and completion.finish_reason == "length":
        return "max_tokens", None
    if completion is not None and isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


def content_blocks(parsed: ExtractedToolCalls, reasoning: str | None = None) -> list[ContentOut]:
    blocks: list[ContentOut] = [ThinkingOut(reasoning)] if reasoning is not None else []
    if parsed.content:
        blocks.append(TextOut(parsed.content))
    for call in parsed.tool_calls:
        blocks.append(ToolUseOut(call.id, call.function.name, _arguments(call.function.arguments)))
    return blocks


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {}  # (a forced call's arguments are JSON by their grammar)


class MessageView:
    """The engine's outputs of one message as Anthropic's message or events."""

    def __init__(self, ctx: ServingContext, chat: PreparedChat, generation: Generation) -> None:
        self.chat = chat
        self.generation = generation
        self.model = ctx.model_name(chat.lora)
        self.text: list[str] = []
        self.num_output_tokens = 0
        self.last: CompletionOutput | None = None
        self.calls: CallStream | None = chat.plan.stream() if chat.plan is not None else None
        self.parser = chat.reasoning_parser  # --reasoning-parser: thinking blocks first
        self.reasoning = ReasoningStream(self.parser) if self.parser is not None else None
        self.num_blocks = 0
        self.open_block: str | None = None  # "thinking", "text", "tool_use" or None

    @property
    def num_input_tokens(self) -> int:
        return len(self.chat.prompt.token_ids)

    def _take(self, completion: CompletionOutput) -> None:
        self.text.append(completion.text)
        self.num_output_tokens += len(completion.token_ids)
        if completion.finish_reason is not None:
            self.last = completion

    async def complete(self) -> Message:
        async for _, output in self.generation.outputs():
            for completion in output.outputs:
                self._take(completion)
        text, reasoning = "".join(self.text), None
        if self.parser is not None:
            split = split_reasoning(self.parser, text)
            text, reasoning = split.content or "", split.reasoning
        plan = self.chat.plan
        parsed = plan.extract(text) if plan is not None else ExtractedToolCalls(text)
        reason, sequence = stop_reason(self.last, parsed.called)
        usage = Usage(self.num_input_tokens, self.num_output_tokens)
        blocks = content_blocks(parsed, reasoning)
        return Message(self.generation.request_id, self.model, blocks, reason, sequence, usage)

    # streaming

    def add_start(self, events: EventStream) -> None:
        usage = Usage(self.num_input_tokens, 0)
        message = Message(self.generation.request_id, self.model, [], None, None, usage)
        events.add(MessageStart(message))

    def add_events(self, events: EventStream, prompt_index: int, output: RequestOutput) -> None:
        for completion in output.outputs:
            self._take(completion)
            text = completion.text
            if self.reasoning is not None:
                final = completion.finish_reason is not None
                thinking, text = self.reasoning.feed(text, final=final)
                if thinking:
                    if self.open_block != "thinking":
                        self._start_block(events, ThinkingOut(""), "thinking")
                    events.add(ContentBlockDelta(self.num_blocks - 1, ThinkingDelta(thinking)))
            if self.calls is None:
                self._add_text(events, text)
                continue
            parsed = self.calls.feed(text)
            if completion.finish_reason is not None:
                parsed.extend(self.calls.finish())
            self._add_text(events, parsed.content)
            for delta in parsed.tool_calls:
                self._add_tool_delta(events, delta)

    def _add_text(self, events: EventStream, text: str) -> None:
        if not text:
            return
        if self.open_block != "text":
            self._start_block(events, TextOut(""), "text")
        events.add(ContentBlockDelta(self.num_blocks - 1, TextDelta(text)))

    def _add_tool_delta(self, events: EventStream, delta: DeltaToolCall) -> None:
        function = delta.function
        if delta.id is not None:  # a call's first delta: its id and name
            name = function.name if function is not None and function.name else ""
            self._start_block(events, ToolUseOut(delta.id, name, {}), "tool_use")
        if function is not None and function.arguments:
            events.add(ContentBlockDelta(self.num_blocks - 1, InputJsonDelta(function.arguments)))

    def _start_block(self, events: EventStream, block: ContentOut, kind: str) -> None:
        self._stop_block(events)
        events.add(ContentBlockStart(self.num_blocks, block))
        self.num_blocks += 1
        self.open_block = kind

    def _stop_block(self, events: EventStream) -> None:
        if self.open_block is not None:
            events.add(ContentBlockStop(self.num_blocks - 1))
            self.open_block = None

    def add_end(self, events: EventStream) -> None:
        self._stop_block(events)
        called = self.calls is not None and self.calls.called
        reason, sequence = stop_reason(self.last, called)
        events.add(MessageDelta(StopDelta(reason, sequence), OutputUsage(self.num_output_tokens)))
        events.add(MessageStop())


class AnthropicEventStream(NamedSseStream):
    """Anthropic's server-sent events: ``event: <type>`` before each ``data:``, no ``[DONE]``,
    an error as an ``error`` event."""

    def error_event(self, error: ApiError) -> Any:
        return error_body(error)
