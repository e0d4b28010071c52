"""``POST /v1/chat/completions``: the chat template renders the messages into one prompt; ``n``
choices, logprobs/top_logprobs, streamed (role chunk first) or answered whole."""

from __future__ import annotations

import time

import msgspec
from aiohttp import web

from shoal.engine.client.outputs import CompletionOutput, RequestOutput
from shoal.gateway.generation import Generation
from shoal.gateway.logprobs import TokenText, chat_logprobs
from shoal.gateway.params import (
    chat_prompt,
    check_unsupported,
    message_text,
    resolve_max_tokens,
    sampling_params,
)
from shoal.gateway.request_types import ChatCompletionRequest
from shoal.gateway.response_types import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    DeltaMessage,
    Usage,
)
from shoal.gateway.serving import (
    Choice,
    EventStream,
    ServingContext,
    UsageCounter,
    decode_body,
    new_request_id,
    now_seconds,
    stream_events,
)

ASSISTANT = "assistant"


async def create_chat_completion(ctx: ServingContext, request: web.Request) -> web.StreamResponse:
    arrival_time = time.time()
    body = await decode_body(request, ChatCompletionRequest)
    ctx.check_model(body.model)
    check_unsupported(body)
    prompt = chat_prompt(ctx.engine, body)
    requested: int | None = body.max_tokens
    max_param = "max_tokens"
    if body.max_completion_tokens is not None:
        requested, max_param = body.max_completion_tokens, "max_completion_tokens"
    max_tokens = resolve_max_tokens(
        requested,
        len(prompt.token_ids),
        ctx.engine.max_model_len,
        "messages",
        max_tokens_param=max_param,
    )
    params = sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        rename={"logprobs": "top_logprobs", "max_tokens": max_param},
        vocab_size=len(ctx.engine.tokenizer),
    )
    ctx.check_ready()
    generation = Generation(
        ctx.engine, [prompt], [params], new_request_id("chatcmpl"), ctx.metrics, arrival_time
    )
    view = ChatView(ctx, body, generation)
    async with generation:
        if body.stream:
            return await view.stream(request)
        response = await view.complete()
        return web.Response(body=msgspec.json.encode(response), content_type="application/json")


class ChatView:
    """Turns the engine's DELTA outputs into chat choices and chunks."""

    def __init__(
        self, ctx: ServingContext, body: ChatCompletionRequest, generation: Generation
    ) -> None:
        self.ctx = ctx
        self.body = body
        self.generation = generation
        self.choices = [Choice(i) for i in range(body.num_choices)]
        self.logprobs = [ChatLogprobs() for _ in self.choices] if body.logprobs else None
        self.usage = UsageCounter([len(p.token_ids) for p in generation.prompts])
        self.token_text = TokenText(ctx.engine.tokenizer)
        self.created = now_seconds()
        last = body.messages[-1]
        self.echo = message_text(last) if body.echo and last.role == ASSISTANT else ""

    def _delta(self, completion: CompletionOutput) -> ChatChunkChoice | None:
        """The new part of one choice; None when there is nothing new to send."""
        choice = self.choices[completion.index]
        if choice.finish_reason is not None:
            return None
        logprobs = None
        if self.logprobs is not None:
            positions = completion.logprobs or [{} for _ in completion.token_ids]
            num_top = self.body.top_logprobs or 0
            logprobs = chat_logprobs(completion.token_ids, positions, num_top, self.token_text)
            self.logprobs[choice.index].content.extend(logprobs.content)
        choice.add(completion)
        self.usage.add(completion)
        if not completion.text and completion.finish_reason is None and logprobs is None:
            return None
        return ChatChunkChoice(
            choice.index,
            DeltaMessage(content=completion.text),
            logprobs,
            completion.finish_reason,
            completion.stop_reason,
        )

    async def complete(self) -> ChatCompletionResponse:
        async for _, output in self.generation.outputs():
            for completion in output.outputs:
                self._delta(completion)
        choices = [
            ChatChoice(
                c.index,
                ChatMessageOut(ASSISTANT, self.echo + c.text),
                self.logprobs[c.index] if self.logprobs is not None else None,
                c.finish_reason,
                c.stop_reason,
            )
            for c in self.choices
        ]
        return ChatCompletionResponse(
            self.generation.request_id,
            self.created,
            self.ctx.served_model_name,
            choices,
            self.usage.usage(),
        )

    async def stream(self, request: web.Request) -> web.StreamResponse:
        return await stream_events(
            request,
            self.generation,
            self._add,
            add_opening=self._add_openers,
            add_closing=self._add_usage,
        )

    def _add_openers(self, events: EventStream) -> None:
        """The role chunk of every choice, then the echoed assistant message if asked."""
        for choice in self.choices:
            opener = ChatChunkChoice(choice.index, DeltaMessage(role=ASSISTANT, content=""))
            events.add(self._chunk([opener]))
        if self.echo:
            for choice in self.choices:
                echoed = ChatChunkChoice(choice.index, DeltaMessage(content=self.echo))
                events.add(self._chunk([echoed]))

    def _add(self, events: EventStream, prompt_index: int, output: RequestOutput) -> None:
        options = self.body.stream_options
        continuous = options is not None and options.continuous_usage_stats
        for completion in output.outputs:
            delta = self._delta(completion)
            if delta is not None:
                events.add(self._chunk([delta], self.usage.usage() if continuous else None))

    def _add_usage(self, events: EventStream) -> None:
        options = self.body.stream_options
        if options is not None and options.include_usage:
            events.add(self._chunk([], self.usage.usage()))

    def _chunk(
        self, choices: list[ChatChunkChoice], usage: Usage | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            self.generation.request_id,
            self.created,
            self.ctx.served_model_name,
            choices,
            usage=usage,
        )
