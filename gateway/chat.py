"""``POST /v1/chat/completions``: the chat template renders the messages (and any tools, and
vLLM's chat-template fields: ``gateway.chat_prompt``) into one prompt; ``n`` choices,
logprobs/top_logprobs, tool calls (``gateway.tools``), streamed (role chunk first) or answered
whole."""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec
from aiohttp import web

from shoal.bus.messages.lora import LoRARequest
from shoal.bus.messages.sampling import SamplingParams
from shoal.engine.client.outputs import CompletionOutput, RequestOutput
from shoal.gateway.chat_prompt import chat_options, message_text, render_chat
from shoal.gateway.errors import ApiError, bad_request
from shoal.gateway.events import EventStream
from shoal.gateway.generation import Generation
from shoal.gateway.logprobs import TokenText, chat_logprobs
from shoal.gateway.params import Prompt, check_unsupported, resolve_max_tokens, sampling_params
from shoal.gateway.reasoning import ReasoningStream, prompt_closes_thinking, split_reasoning
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
    ServingContext,
    UsageCounter,
    decode_body,
    new_request_id,
    now_seconds,
    stream_events,
)
from shoal.gateway.tools import CallStream, ToolPlan, template_tools, tool_plan

ASSISTANT = "assistant"
PROMPT_TAIL_TOKENS = 16  # enough to hold a closing </think> and the blank lines after it


@dataclass(frozen=True, slots=True)
class PreparedChat:
    """A chat request ready to run: its prompt, sampling parameters, tool plan and adapter."""

    prompt: Prompt
    params: SamplingParams
    plan: ToolPlan | None
    lora: LoRARequest | None
    # how the output's thinking is split off: the server's --reasoning-parser, unless the
    # prompt already closed the thinking (a template told to skip it: Qwen3's
    # chat_template_kwargs enable_thinking false), when the whole output is the answer
    reasoning_parser: str | None = None


def prepare_chat(ctx: ServingContext, body: ChatCompletionRequest) -> PreparedChat:
    """The chat template over the messages and tools, and the request's sampling parameters
    (shared by chat completions and the APIs translated into it: Anthropic's Messages)."""
    lora = ctx.check_model(body.model)
    check_unsupported(body)
    plan = tool_plan(body, ctx.tool_calling)
    trusted = ctx.trust_request_chat_template
    options = chat_options(body, trust_request_chat_template=trusted, tools=template_tools(body))
    prompt = render_chat(
        ctx.engine, body.messages, options, add_special_tokens=body.add_special_tokens
    )
    defaults = ctx.engine.generation_defaults
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
        defaults=defaults,
    )
    params = sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        rename={"logprobs": "top_logprobs", "max_tokens": max_param},
        vocab_size=ctx.engine.vocabulary.model_vocab_size,
        defaults=defaults,
    )
    params = with_tool_plan(params, plan)
    parser = ctx.reasoning_parser
    if parser is not None and _closes_thinking(ctx, prompt):
        parser = None
    constraint = params.structured_outputs
    if parser is not None and not ctx.structured_in_reasoning and constraint is not None:
        after = msgspec.structs.replace(constraint, after_reasoning=parser)
        params = msgspec.structs.replace(params, structured_outputs=after)  # as vLLM applies it
    return PreparedChat(prompt, params, plan, lora, parser)


def _closes_thinking(ctx: ServingContext, prompt: Prompt) -> bool:
    """Whether the rendered prompt ends with the thinking already closed."""
    tail = ctx.engine.tokenizer.decode(prompt.token_ids[-PROMPT_TAIL_TOKENS:])
    return prompt_closes_thinking(tail)


async def create_chat_completion(ctx: ServingContext, request: web.Request) -> web.StreamResponse:
    arrival_time = time.time()
    body = await decode_body(request, ChatCompletionRequest)
    chat = prepare_chat(ctx, body)
    plan = chat.plan
    ctx.check_ready()
    generation = Generation(
        ctx.engine,
        [chat.prompt],
        [chat.params],
        new_request_id("chatcmpl"),
        ctx.metrics,
        arrival_time,
        chat.lora,
    )
    view = ChatView(ctx, body, generation, plan, chat.reasoning_parser)
    try:
        async with generation:
            if body.stream:
                return await view.stream(request)
            response = await view.complete()
            return web.Response(body=msgspec.json.encode(response), content_type="application/json")
    except ApiError as error:
        raise tools_error(error, plan) from None


SO_PARAM = "structured_outputs"  # where the engine client names a grammar it cannot build


def tools_error(error: ApiError, plan: ToolPlan | None) -> ApiError:
    """A grammar the engine client could not build from the tools is the tools' fault."""
    if plan is not None and plan.constraint is not None and error.param == SO_PARAM:
        return bad_request(f"tools: {error.message}", param="tools")
    return error


def with_tool_plan(params: SamplingParams, plan: ToolPlan | None) -> SamplingParams:
    """The sampling parameters a tool plan needs: the grammar of forced calls, and special
    tokens kept in the text when the parser's tags are special tokens."""
    if plan is None:
        return params
    if plan.constraint is not None:
        params = msgspec.structs.replace(params, structured_outputs=plan.constraint)
    if plan.skip_special_tokens is not None:
        params = msgspec.structs.replace(params, skip_special_tokens=plan.skip_special_tokens)
    return params


class ChatView:
    """Turns the engine's DELTA outputs into chat choices and chunks."""

    def __init__(
        self,
        ctx: ServingContext,
        body: ChatCompletionRequest,
        generation: Generation,
        plan: ToolPlan | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        self.ctx = ctx
        self.reasoning_parser = reasoning_parser
        self.body = body
        self.generation = generation
        self.plan = plan
        self.choices = [Choice(i) for i in range(body.num_choices)]
        streams = body.stream and plan is not None
        self.call_streams: list[CallStream] | None = (
            [plan.stream() for _ in self.choices] if streams and plan is not None else None
        )
        self.logprobs = [ChatLogprobs() for _ in self.choices] if body.logprobs else None
        parser = reasoning_parser
        self.reasoning: list[ReasoningStream] | None = (
            [ReasoningStream(parser) for _ in self.choices] if parser and body.stream else None
        )
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
        reasoning, text = self._reasoning_delta(completion)
        if self.call_streams is None:
            delta = DeltaMessage(content=text)
            finish_reason = completion.finish_reason
        else:
            delta, finish_reason = self._tool_delta(completion, text)
        delta.reasoning_content = reasoning or None
        new = delta.content or delta.tool_calls or delta.reasoning_content
        if not new and finish_reason is None and logprobs is None:
            return None
        return ChatChunkChoice(choice.index, delta, logprobs, finish_reason, completion.stop_reason)

    def _reasoning_delta(self, completion: CompletionOutput) -> tuple[str, str]:
        """A streamed choice's new reasoning and content (all content without a parser)."""
        if self.reasoning is None:
            return "", completion.text
        stream = self.reasoning[completion.index]
        return stream.feed(completion.text, final=completion.finish_reason is not None)

    def _tool_delta(
        self, completion: CompletionOutput, text: str
    ) -> tuple[DeltaMessage, str | None]:
        """A streamed choice's content through its tool-call parser."""
        assert self.call_streams is not None and self.plan is not None
        stream = self.call_streams[completion.index]
        parsed = stream.feed(text)
        reason = completion.finish_reason
        if reason is not None:
            parsed.extend(stream.finish())
            reason = self.plan.finish_reason(stream.called, reason)
        content = parsed.content if parsed.content or not parsed.tool_calls else None
        return DeltaMessage(content=content, tool_calls=parsed.tool_calls or None), reason

    def _message(self, choice: Choice) -> tuple[ChatMessageOut, str | None]:
        """A whole choice's message (its reasoning split off, its tool calls parsed out of the
        rest) and finish reason."""
        reasoning, text = None, choice.text
        if self.reasoning_parser is not None:
            split = split_reasoning(self.reasoning_parser, text)
            reasoning, text = split.reasoning, split.content or ""
        if self.plan is None:
            content = (self.echo + text) if text or reasoning is None else None
            message = ChatMessageOut(ASSISTANT, content, reasoning_content=reasoning)
            return message, choice.finish_reason
        parsed = self.plan.extract(text)
        content = parsed.content
        if self.echo:
            content = self.echo + (content or "")
        reason = self.plan.finish_reason(parsed.called, choice.finish_reason)
        message = ChatMessageOut(
            ASSISTANT, content, tool_calls=parsed.tool_calls, reasoning_content=reasoning
        )
        return message, reason

    async def complete(self) -> ChatCompletionResponse:
        async for _, output in self.generation.outputs():
            for completion in output.outputs:
                self._delta(completion)
        choices = []
        for c in self.choices:
            message, reason = self._message(c)
            logprobs = self.logprobs[c.index] if self.logprobs is not None else None
            choices.append(ChatChoice(c.index, message, logprobs, reason, c.stop_reason))
        return ChatCompletionResponse(
            self.generation.request_id,
            self.created,
            self.ctx.model_name(self.generation.lora_request),
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
            self.ctx.model_name(self.generation.lora_request),
            choices,
            usage=usage,
        )
