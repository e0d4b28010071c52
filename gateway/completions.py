"""``POST /v1/completions``: text or token-id prompts (one or a batch), ``n`` choices each,
echo and logprobs, streamed as server-sent events or answered whole.

``echo`` with ``max_tokens: 0`` scores a prompt (as evaluation harnesses do): the answer is the
prompt's text and, with ``logprobs``, its prompt logprobs, with no generated token. The engine
cannot run a request that generates nothing, so it runs one that asks for the prompt logprobs
and one token, and that token is dropped here (vLLM does the same).
"""

from __future__ import annotations

import dataclasses
import time

import msgspec
from aiohttp import web

from shoal.engine.client.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from shoal.gateway.errors import bad_request
from shoal.gateway.events import EventStream
from shoal.gateway.generation import Generation
from shoal.gateway.logprobs import TokenText, append_completion_logprobs
from shoal.gateway.params import (
    Prompt,
    check_unsupported,
    completion_prompts,
    resolve_max_tokens,
    sampling_params,
)
from shoal.gateway.request_types import MAX_CHOICES, CompletionRequest
from shoal.gateway.response_types import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
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


async def create_completion(ctx: ServingContext, request: web.Request) -> web.StreamResponse:
    arrival_time = time.time()
    body = await decode_body(request, CompletionRequest)
    lora = ctx.check_model(body.model)
    check_unsupported(body)
    engine = ctx.engine
    max_model_len = engine.max_model_len
    prompts = completion_prompts(
        body.prompt, engine.tokenizer, engine.vocabulary, max_model_len, body.add_special_tokens
    )
    if len(prompts) * body.num_choices > MAX_CHOICES:
        raise bad_request(f"at most {MAX_CHOICES} choices (prompts × n) per request", param="n")
    echo_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    prompt_only = is_prompt_only(body)
    requested = 1 if prompt_only else body.max_tokens
    params = [
        sampling_params(
            body,
            max_tokens=resolve_max_tokens(
                requested,
                len(p.token_ids),
                max_model_len,
                "prompt",
                max_tokens_param="max_tokens",
                defaults=engine.generation_defaults,
            ),
            logprobs=None if prompt_only else body.logprobs,
            prompt_logprobs=echo_logprobs,
            vocab_size=engine.vocabulary.model_vocab_size,
            defaults=engine.generation_defaults,
        )
        for p in prompts
    ]
    ctx.check_ready()
    generation = Generation(
        engine, prompts, params, new_request_id("cmpl"), ctx.metrics, arrival_time, lora
    )
    view = CompletionView(ctx, body, prompts, generation)
    async with generation:
        if body.stream:
            return await view.stream(request)
        response = await view.complete()
        return web.Response(body=msgspec.json.encode(response), content_type="application/json")


def is_prompt_only(body: CompletionRequest) -> bool:
    """``echo`` with ``max_tokens: 0``: the prompt (and its logprobs) without generation."""
    return bool(body.echo) and body.max_tokens == 0


def without_generation(completion: CompletionOutput) -> CompletionOutput:
    """The completion with its generated token dropped; a finished one ends at its length."""
    finish_reason = None if completion.finish_reason is None else "length"
    return dataclasses.replace(
        completion,
        text="",
        token_ids=[],
        logprobs=None,
        finish_reason=finish_reason,
        stop_reason=None,
    )


class CompletionView:
    """Turns the engine's DELTA outputs into completions choices and chunks."""

    def __init__(
        self,
        ctx: ServingContext,
        body: CompletionRequest,
        prompts: list[Prompt],
        generation: Generation,
    ) -> None:
        self.ctx = ctx
        self.body = body
        self.prompts = prompts
        self.generation = generation
        self.n = body.num_choices
        self.prompt_only = is_prompt_only(body)
        self.choices = [Choice(i) for i in range(len(prompts) * self.n)]
        self.offsets = [0] * len(self.choices)
        self.usage = UsageCounter([len(p.token_ids) for p in prompts])
        self.prompt_logprobs: list[list[TokenLogprobs | None] | None] = [None] * len(prompts)
        self.token_text = TokenText(ctx.engine.tokenizer)
        self.created = now_seconds()

    def _delta(self, prompt_index: int, completion: CompletionOutput) -> CompletionChoice | None:
        """The new part of one choice, echo included on its first delta; None when there is no
        text (held back, say) and nothing else to send."""
        choice = self.choices[prompt_index * self.n + completion.index]
        if choice.finish_reason is not None:
            return None
        if self.prompt_only:
            completion = without_generation(completion)
        text = completion.text
        logprobs = CompletionLogprobs() if self.body.logprobs is not None else None
        if not choice.started and self.body.echo:
            text = self._echo(prompt_index, choice.index, logprobs) + text
        choice.started = True
        if logprobs is not None:
            positions = completion.logprobs or [{} for _ in completion.token_ids]
            self.offsets[choice.index] = append_completion_logprobs(
                logprobs,
                completion.token_ids,
                positions,
                self.body.logprobs or 0,
                self.token_text,
                self.offsets[choice.index] + len(text) - len(completion.text),
            )
        choice.add(completion)
        self.usage.add(completion)
        if not text and completion.finish_reason is None and logprobs is None:
            return None
        return CompletionChoice(
            choice.index, text, logprobs, completion.finish_reason, completion.stop_reason
        )

    def _echo(self, prompt_index: int, index: int, logprobs: CompletionLogprobs | None) -> str:
        prompt = self.prompts[prompt_index]
        text = prompt.text
        if text is None:
            text = self.ctx.engine.tokenizer.decode(prompt.token_ids)
        if logprobs is not None:
            positions = self.prompt_logprobs[prompt_index] or [None] * len(prompt.token_ids)
            append_completion_logprobs(
                logprobs, prompt.token_ids, positions, self.body.logprobs or 0, self.token_text, 0
            )
        self.offsets[index] = 0
        return text

    def _note_prompt(self, prompt_index: int, output: RequestOutput) -> None:
        if output.prompt_logprobs is not None and self.prompt_logprobs[prompt_index] is None:
            self.prompt_logprobs[prompt_index] = output.prompt_logprobs

    async def complete(self) -> CompletionResponse:
        merged: dict[int, CompletionChoice] = {}
        async for prompt_index, output in self.generation.outputs():
            self._note_prompt(prompt_index, output)
            for completion in output.outputs:
                delta = self._delta(prompt_index, completion)
                if delta is not None:
                    _merge(merged, delta)
        choices = [merged.get(c.index) or CompletionChoice(c.index, "") for c in self.choices]
        for choice, state in zip(choices, self.choices, strict=True):
            choice.finish_reason, choice.stop_reason = state.finish_reason, state.stop_reason
        return CompletionResponse(
            self.generation.request_id,
            self.created,
            self.ctx.model_name(self.generation.lora_request),
            choices,
            self.usage.usage(),
        )

    async def stream(self, request: web.Request) -> web.StreamResponse:
        return await stream_events(request, self.generation, self._add, add_closing=self._add_usage)

    def _add(self, events: EventStream, prompt_index: int, output: RequestOutput) -> None:
        self._note_prompt(prompt_index, output)
        options = self.body.stream_options
        continuous = options is not None and options.continuous_usage_stats
        for completion in output.outputs:
            delta = self._delta(prompt_index, completion)
            if delta is not None:
                usage = self.usage.usage() if continuous else None
                events.add(self._chunk([delta], usage))

    def _add_usage(self, events: EventStream) -> None:
        options = self.body.stream_options
        if options is not None and options.include_usage:
            events.add(self._chunk([], self.usage.usage()))

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None) -> CompletionChunk:
        return CompletionChunk(
            self.generation.request_id,
            self.created,
            self.ctx.model_name(self.generation.lora_request),
            choices,
            usage=usage,
        )


def _merge(merged: dict[int, CompletionChoice], delta: CompletionChoice) -> None:
    """Fold one delta into the choice's accumulated text and logprobs."""
    total = merged.get(delta.index)
    if total is None:
        merged[delta.index] = delta
        return
    total.text += delta.text
    if total.logprobs is not None and delta.logprobs is not None:
        for name in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
            getattr(total.logprobs, name).extend(getattr(delta.logprobs, name))
