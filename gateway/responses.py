"""``POST /v1/responses`` (OpenAI's Responses API), ``GET /v1/responses/{id}`` and its cancel.

A request's ``input`` (a string, or items: messages, function calls and their outputs) after
``instructions`` and, with ``previous_response_id``, the stored conversation it continues,
becomes a chat request (function tools, ``tool_choice``, ``text.format`` as a JSON-schema
grammar), runs as chat completions run (``chat.prepare_chat``), and is answered as a response
object whose output items are the reasoning (``--reasoning-parser``), the message and the
function calls; streamed, as the typed events (``response.created`` ...
``response.completed``), text deltas as they come. ``store`` (the default) keeps the response
and its conversation in the deployment's key-value bucket (``response_store``) for any gateway.
Only background responses can be cancelled, and shoal runs none: cancel answers so.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from shoal.engine.client.outputs import CompletionOutput, RequestOutput
from shoal.gateway.chat import PreparedChat, prepare_chat, tools_error
from shoal.gateway.errors import ApiError, bad_request
from shoal.gateway.events import EventStream, NamedSseStream, write_stream
from shoal.gateway.generation import Generation
from shoal.gateway.reasoning import count_reasoning_tokens, split_reasoning
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
from shoal.gateway.response_store import StoredResponse
from shoal.gateway.responses_types import (
    FunctionCallItem,
    IncompleteDetails,
    MessageItem,
    OutputItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    Response,
    ResponsesRequest,
    ResponseUsage,
    TextOptions,
)
from shoal.gateway.serving import ServingContext, decode_body
from shoal.gateway.tool_parsers.calls import ExtractedToolCalls

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", code="not_found")


async def create_response(ctx: ServingContext, request: web.Request) -> web.StreamResponse:
    arrival_time = time.time()
    body = await decode_body(request, ResponsesRequest)
    if not body.stream:
        response = await respond(ctx, body, arrival_time)
        return web.Response(body=msgspec.json.encode(response), content_type="application/json")
    events = ResponseEventStream(request, ctx.sse_keep_alive_s)
    await respond(ctx, body, arrival_time, events)
    return events.response


async def respond(
    ctx: ServingContext,
    body: ResponsesRequest,
    arrival_time: float,
    events: EventStream | None = None,
) -> Response | None:
    """Run one Responses request (the HTTP and NATS APIs' shared part): streamed into
    ``events`` (None returned), else answered whole; stored either way unless ``store`` is
    false."""
    if body.background:
        raise bad_request("background responses are not supported", param="background")
    history: list[ChatMessage] = []
    if body.previous_response_id is not None:
        stored = await ctx.responses.get(body.previous_response_id)
        if stored is None:
            raise not_found(body.previous_response_id)
        history = stored.messages
    conversation = [*history, *input_messages(body.input)]
    chat = prepare_chat(ctx, chat_request(body, conversation))
    ctx.check_ready()
    response_id = new_id("resp")
    generation = Generation(
        ctx.engine, [chat.prompt], [chat.params], response_id, ctx.metrics, arrival_time, chat.lora
    )
    view = ResponseView(ctx, body, chat, generation, conversation)
    try:
        async with generation:
            if events is not None:
                await write_stream(
                    events,
                    generation,
                    view.add_events,
                    add_opening=view.add_start,
                    add_closing=view.add_end,
                )
                if view.final is not None:
                    await view.store(view.final)
                return None
            response = await view.complete()
    except ApiError as error:
        raise tools_error(error, chat.plan) from None
    await view.store(response)
    return response


async def stored_response(ctx: ServingContext, response_id: str) -> Response:
    """A stored response (404 if there is none by that id)."""
    stored = await ctx.responses.get(response_id)
    if stored is None:
        raise not_found(response_id)
    return stored.response


async def get_response(ctx: ServingContext, request: web.Request) -> web.Response:
    response = await stored_response(ctx, request.match_info["response_id"])
    return web.Response(body=msgspec.json.encode(response), content_type="application/json")


async def cancel_response(ctx: ServingContext, request: web.Request) -> web.Response:
    await stored_response(ctx, request.match_info["response_id"])
    raise bad_request("Cannot cancel a synchronous response: only background responses can be")


# ----- the request, as a chat request


def input_messages(given: str | list[dict[str, Any]]) -> list[ChatMessage]:
    if isinstance(given, str):
        return [ChatMessage("user", given)]
    messages: list[ChatMessage] = []
    for item in given:
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item))
        elif kind == "function_call":
            call = MessageToolCall(
                str(item.get("call_id")),
                CalledFunction(str(item.get("name")), str(item.get("arguments", ""))),
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and not last.content:
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage("assistant", "", tool_calls=[call]))
        elif kind == "function_call_output":
            output = item.get("output", "")
            text = output if isinstance(output, str) else json.dumps(output)
            messages.append(ChatMessage("tool", text, tool_call_id=str(item.get("call_id"))))
        elif kind != "reasoning":  # earlier reasoning is not replayed
            raise bad_request(f"input items of type {kind!r} are not supported", param="input")
    return messages


def _message(item: dict[str, Any]) -> ChatMessage:
    role = ROLES.get(str(item.get("role")))
    if role is None:
        raise bad_request(
            f"input message role {item.get('role')!r} is not supported", param="input"
        )
    content = item.get("content", "")
    if isinstance(content, str):
        return ChatMessage(role, content)
    texts = []
    for part in content if isinstance(content, list) else []:
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else part
            raise bad_request(f"content parts of type {kind!r} are not supported", param="input")
        texts.append(str(part.get("text", "")))
    return ChatMessage(role, "".join(texts))


def chat_request(body: ResponsesRequest, conversation: list[ChatMessage]) -> ChatCompletionRequest:
    messages = conversation
    if body.instructions:
        messages = [ChatMessage("system", body.instructions), *conversation]
    tools = []
    for tool in body.tools or []:
        if tool.type != "function" or not tool.name:
            raise bad_request(f"tools of type {tool.type!r} are not supported", param="tools")
        tools.append(ChatTool(FunctionDefinition(tool.name, tool.description, tool.parameters)))
    choice: str | NamedToolChoice | None = None
    if isinstance(body.tool_choice, dict):
        choice = NamedToolChoice(NamedFunction(str(body.tool_choice.get("name"))))
    elif body.tool_choice is not None:
        choice = body.tool_choice
    return ChatCompletionRequest(
        model=body.model,
        messages=messages,
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        tools=tools or None,
        tool_choice=choice if tools else None,
        parallel_tool_calls=body.parallel_tool_calls,
        structured_outputs=_format(body),
        ignore_eos=body.ignore_eos,
    )


def _format(body: ResponsesRequest) -> dict[str, Any] | None:
    """``text.format`` as vLLM's ``structured_outputs`` (or those given as such)."""
    if body.text is None or body.text.format.type == "text":
        return body.structured_outputs
    if body.structured_outputs is not None:
        raise bad_request("give text.format or structured_outputs, not both", param="text")
    fmt = body.text.format
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.type == "json_schema" and fmt.schema is not None:
        return {"json": fmt.schema}
    raise bad_request(f"text.format of type {fmt.type!r} needs a schema", param="text.format")


# ----- the answer


class ResponseView:
    """The engine's outputs of one response as the response object or its events."""

    def __init__(
        self,
        ctx: ServingContext,
        body: ResponsesRequest,
        chat: PreparedChat,
        generation: Generation,
        conversation: list[ChatMessage],
    ) -> None:
        self.ctx = ctx
        self.body = body
        self.chat = chat
        self.generation = generation
        self.conversation = conversation
        self.created_at = int(time.time())
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.last: CompletionOutput | None = None
        # streamed text goes out as it comes when nothing is parsed out of it
        self.live = chat.plan is None and chat.reasoning_parser is None
        self.message_id = new_id("msg")
        self.sequence = 0
        self.final: Response | None = None  # a stream's last response, to store

    def _take(self, output: RequestOutput) -> list[str]:
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        texts = []
        for completion in output.outputs:
            self.texts.append(completion.text)
            self.token_ids.extend(completion.token_ids)
            texts.append(completion.text)
            self.num_output_tokens += len(completion.token_ids)
            if completion.finish_reason is not None:
                self.last = completion
        return texts

    async def complete(self) -> Response:
        async for _, output in self.generation.outputs():
            self._take(output)
        return self.response(self.items(), "completed")

    def items(self) -> list[OutputItem]:
        text = "".join(self.texts)
        items: list[OutputItem] = []
        if self.chat.reasoning_parser is not None:
            split = split_reasoning(self.chat.reasoning_parser, text)
            if split.reasoning is not None:
                items.append(ReasoningItem(new_id("rs"), [ReasoningText(split.reasoning)]))
            text = split.content or ""
        plan = self.chat.plan
        parsed = plan.extract(text) if plan is not None else ExtractedToolCalls(text or None)
        if parsed.content:
            items.append(MessageItem(self.message_id, [OutputText(parsed.content)]))
        for call in parsed.tool_calls:
            function = call.function
            items.append(FunctionCallItem(new_id("fc"), call.id, function.name, function.arguments))
        return items

    def response(self, output: list[OutputItem], status: str) -> Response:
        body = self.body
        incomplete = None
        if status == "completed" and self.last is not None and self.last.finish_reason == "length":
            status, incomplete = "incomplete", IncompleteDetails("max_output_tokens")
        num_input = len(self.chat.prompt.token_ids)
        usage = ResponseUsage(num_input, self.num_output_tokens, num_input + self.num_output_tokens)
        usage.input_tokens_details.cached_tokens = self.num_cached_tokens
        usage.output_tokens_details.reasoning_tokens = self._num_reasoning_tokens()
        return Response(
            id=self.generation.request_id,
            created_at=self.created_at,
            model=self.ctx.model_name(self.chat.lora),
            status=status,
            output=output,
            usage=usage,
            incomplete_details=incomplete,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            previous_response_id=body.previous_response_id,
            temperature=body.temperature,
            top_p=body.top_p,
            tools=body.tools or [],
            tool_choice=body.tool_choice or "auto",
            parallel_tool_calls=body.parallel_tool_calls is not False,
            text=body.text or TextOptions(),
            metadata=body.metadata or {},
        )

    def _num_reasoning_tokens(self) -> int:
        parser = self.chat.reasoning_parser
        if parser is None or not self.token_ids:
            return 0
        tokenizer = self.ctx.engine.tokenizer
        return count_reasoning_tokens(parser, self.token_ids, lambda ids: tokenizer.decode(ids))

    async def store(self, response: Response) -> None:
        if not self.body.store:
            return
        await self.ctx.responses.put(
            StoredResponse(response, [*self.conversation, *_as_messages(response.output)])
        )

    # streaming

    def _event(self, events: EventStream, kind: str, **fields: Any) -> None:
        events.add({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1

    def add_start(self, events: EventStream) -> None:
        opening = self.response([], "in_progress")
        self._event(events, "response.created", response=opening)
        self._event(events, "response.in_progress", response=opening)
        if self.live:
            self._open_message(events, 0)

    def _open_message(self, events: EventStream, index: int) -> None:
        item = MessageItem(self.message_id, [], status="in_progress")
        self._event(events, "response.output_item.added", output_index=index, item=item)
        self._event(
            events,
            "response.content_part.added",
            item_id=self.message_id,
            output_index=index,
            content_index=0,
            part=OutputText(""),
        )

    def add_events(self, events: EventStream, prompt_index: int, output: RequestOutput) -> None:
        for text in self._take(output):
            if self.live and text:
                self._event(
                    events,
                    "response.output_text.delta",
                    item_id=self.message_id,
                    output_index=0,
                    content_index=0,
                    delta=text,
                    logprobs=[],
                )

    def add_end(self, events: EventStream) -> None:
        items = self.items()
        if self.live and not items:  # nothing was said: the opened message stays, empty
            items = [MessageItem(self.message_id, [OutputText("")])]
        for index, item in enumerate(items):
            self._add_item(events, index, item)
        response = self.response(items, "completed")
        kind = "response.completed" if response.status == "completed" else "response.incomplete"
        self._event(events, kind, response=response)
        self.final = response

    def _add_item(self, events: EventStream, index: int, item: OutputItem) -> None:
        if isinstance(item, MessageItem):
            if not (self.live and index == 0):
                self._open_message(events, index)
                delta = item.content[0].text
                self._event(
                    events, "response.output_text.delta", item_id=item.id, output_index=index,
                    content_index=0, delta=delta, logprobs=[],
                )  # fmt: skip
            text = item.content[0].text
            common = {"item_id": item.id, "output_index": index, "content_index": 0}
            self._event(events, "response.output_text.done", text=text, logprobs=[], **common)
            self._event(events, "response.content_part.done", part=item.content[0], **common)
        elif isinstance(item, FunctionCallItem):
            opened = msgspec.structs.replace(item, arguments="", status="in_progress")
            self._event(events, "response.output_item.added", output_index=index, item=opened)
            common = {"item_id": item.id, "output_index": index}
            self._event(
                events, "response.function_call_arguments.delta", delta=item.arguments, **common
            )
            self._event(
                events, "response.function_call_arguments.done", arguments=item.arguments, **common
            )
        else:
            self._event(events, "response.output_item.added", output_index=index, item=item)
        self._event(events, "response.output_item.done", output_index=index, item=item)


def _as_messages(output: list[OutputItem]) -> list[ChatMessage]:
    """A response's output as the conversation's next assistant message."""
    text = "".join(p.text for item in output if isinstance(item, MessageItem) for p in item.content)
    calls = [
        MessageToolCall(item.call_id, CalledFunction(item.name, item.arguments))
        for item in output
        if isinstance(item, FunctionCallItem)
    ]
    return [ChatMessage("assistant", text, tool_calls=calls or None)]


class ResponseEventStream(NamedSseStream):
    """The Responses API's events: ``event: <type>`` before each ``data:``, no ``[DONE]``; an
    error is an ``error`` event numbered after the events before it."""

    num_events = 0

    def add(self, event: Any) -> None:
        super().add(event)
        self.num_events += 1

    def error_event(self, error: ApiError) -> Any:
        return {
            "type": "error",
            "code": error.code,
            "message": error.message,
            "param": error.param,
            "sequence_number": self.num_events,
        }
