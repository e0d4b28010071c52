"""A deterministic fake ``EngineClientInterface`` for the gateway's tests (checked by
test_gateway_fake_engine).

Tokens come from a tiny byte-level BPE tokenizer trained here; each next token is a pure
function of (prompt, choice index, step, seed), so a request always produces the same text.
It honours max_tokens, min_tokens, n, stop strings (with hold-back in DELTA mode), stop token
ids, EOS (``eos_after``), ignore_eos, logprobs, prompt_logprobs and the three output kinds; it
records requests, aborts and what is in flight, and can be made unready or overloaded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import re
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from shoal.bus.messages.engine import SchedulerStats
from shoal.bus.messages.lora import LoRARequest
from shoal.bus.messages.sampling import OutputKind, SamplingParams
from shoal.config.deployment import ShoalConfig
from shoal.engine.client.chat_options import ChatOptions
from shoal.engine.client.generation_defaults import GenerationDefaults
from shoal.engine.client.interface import EngineUnavailableError, RequestValidationError
from shoal.engine.client.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from shoal.engine.client.tokenizer import Tokenizer
from shoal.engine.client.vocabulary import Vocabulary

MODEL_NAME = "fake-model"
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a small model writes short stories about rivers and mountains",
    "shoal serves many requests at once with paged attention",
    "every actor can die and come back without losing a request",
] * 20
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@functools.cache
def fake_tokenizer() -> Any:
    """A byte-level BPE tokenizer trained on a few sentences, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
    )


@functools.cache
def word_token_ids() -> tuple[int, ...]:
    """Ids that decode to ' word' (a space and lowercase letters): the fake's output alphabet."""
    tokenizer = fake_tokenizer()
    ids = [i for i in range(len(tokenizer)) if re.fullmatch(r" [a-z]{2,}", tokenizer.decode([i]))]
    return tuple(sorted(ids))


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


@dataclass
class _Choice:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    text: str = ""
    sent_tokens: int = 0
    sent_chars: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class FakeEngineClient:
    """Implements ``engine.client.interface.EngineClientInterface`` without a model."""

    def __init__(
        self,
        *,
        max_model_len: int = 256,
        token_delay: float = 0.0,
        eos_after: int | None = None,
        max_in_flight: int = 1_000,
        model_name: str = MODEL_NAME,
    ) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.lora_requests: list[LoRARequest | None] = []  # each generate call's adapter
        self.tokenizer = fake_tokenizer()
        self.vocabulary = Vocabulary(len(self.tokenizer) - 1, len(self.tokenizer))
        self.generation_defaults = GenerationDefaults()
        self.token_delay = token_delay
        self.eos_after = eos_after
        self.max_in_flight = max_in_flight
        self.ready = True
        self.fail_at_step: int | None = None  # raise RuntimeError at this step (engine death)
        self.in_flight: set[str] = set()
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.requests: list[tuple[str, list[int], SamplingParams]] = []
        self.on_stats: Callable[[SchedulerStats, str], None] | None = None
        self._num_steps = 0

    def is_ready(self) -> bool:
        return self.ready

    def accepts_requests(self) -> bool:
        return self.ready

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        options: ChatOptions | None = None,
        *,
        add_special_tokens: bool = False,
    ) -> list[int]:
        tokenizer = Tokenizer(self.tokenizer)
        return tokenizer.encode_chat(messages, options, add_special_tokens=add_special_tokens)

    async def abort(self, request_id: str) -> None:
        if request_id in self.in_flight and request_id not in self.aborted:
            self.aborted.append(request_id)

    # --- the deterministic "model" ----------------------------------------------------------

    def next_token(self, prompt: list[int], params: SamplingParams, index: int, step: int) -> int:
        eos_due = self.eos_after is not None and step >= max(self.eos_after, params.min_tokens)
        if eos_due and not params.ignore_eos:
            return int(self.tokenizer.eos_token_id)
        seed = (params.seed or 0) if not params.is_greedy else 0
        mix = 0
        for value in (sum(prompt), len(prompt), prompt[-1], index, step, seed):
            mix = _splitmix(mix ^ value)
        words = word_token_ids()
        return words[mix % len(words)]

    def fake_logprobs(self, token_id: int, top: int) -> dict[int, Logprob]:
        """The chosen token at -0.5 (rank 1) plus ``top - 1`` alternatives below it."""
        words = word_token_ids()
        entries = {token_id: Logprob(-0.5, 1, self.tokenizer.decode([token_id]))}
        for k, alt in enumerate(w for w in words if w != token_id):
            if len(entries) >= max(top, 1):
                break
            entries[alt] = Logprob(-1.0 - k, k + 2, self.tokenizer.decode([alt]))
        return entries

    # --- generate ---------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        self.lora_requests.append(lora_request)
        ids = list(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)
        self._admit(request_id, ids, sampling_params)
        metrics = RequestMetrics(arrival_time=time.time(), first_scheduled_time=time.time())
        choices = [_Choice(i) for i in range(sampling_params.n)]
        done = False
        try:
            step = 0
            while any(c.finish_reason is None for c in choices):
                await asyncio.sleep(self.token_delay)
                if step == self.fail_at_step:
                    raise RuntimeError("engine core died")
                for choice in choices:
                    if choice.finish_reason is None:
                        self._advance(choice, ids, sampling_params, step)
                step += 1
                self._publish_stats()
                finished = all(c.finish_reason is not None for c in choices)
                now = time.time()
                metrics.first_token_time = metrics.first_token_time or now
                metrics.last_token_time = now
                if finished:
                    metrics.finished_time = now
                output = self._output(request_id, ids, choices, sampling_params, finished, metrics)
                if output is not None:
                    yield output
            done = True
        finally:
            self.in_flight.discard(request_id)
            (self.finished if done else self.aborted).append(request_id)

    def _admit(self, request_id: str, ids: list[int], params: SamplingParams) -> None:
        if not self.ready:
            raise EngineUnavailableError("no engine core is ready")
        if len(self.in_flight) >= self.max_in_flight:
            raise EngineUnavailableError("every engine core queue is full")
        if len(ids) >= self.max_model_len:
            raise RequestValidationError("prompt is too long", param="prompt")
        if request_id in self.in_flight:
            raise RequestValidationError(f"duplicate request id {request_id}")
        self.in_flight.add(request_id)
        self.requests.append((request_id, ids, params))

    def _advance(
        self, choice: _Choice, prompt: list[int], params: SamplingParams, step: int
    ) -> None:
        token = self.next_token(prompt, params, choice.index, step)
        choice.token_ids.append(token)
        if params.logprobs is not None:
            choice.logprobs.append(self.fake_logprobs(token, params.logprobs))
        if token == self.tokenizer.eos_token_id or token in (params.stop_token_ids or ()):
            choice.finish_reason, choice.stop_reason = "stop", token
        choice.text = self.tokenizer.decode(choice.token_ids, skip_special_tokens=True)
        if choice.finish_reason is None and len(choice.token_ids) >= params.min_tokens:
            self._check_stop_strings(choice, params)
        if choice.finish_reason is None and len(choice.token_ids) >= (params.max_tokens or 1 << 30):
            choice.finish_reason = "length"

    @staticmethod
    def _check_stop_strings(choice: _Choice, params: SamplingParams) -> None:
        hits = [(choice.text.find(s), s) for s in params.all_stop_strings if s in choice.text]
        if not hits:
            return
        position, stop = min(hits, key=lambda hit: hit[0] + len(hit[1]))
        end = position + len(stop) if params.include_stop_str_in_output else position
        choice.text = choice.text[:end]
        choice.finish_reason, choice.stop_reason = "stop", stop

    def _output(
        self,
        request_id: str,
        prompt: list[int],
        choices: list[_Choice],
        params: SamplingParams,
        finished: bool,
        metrics: RequestMetrics,
    ) -> RequestOutput | None:
        kind = params.output_kind
        if kind == OutputKind.FINAL_ONLY and not finished:
            return None
        first = all(c.sent_tokens == 0 for c in choices)
        outputs = [o for c in choices if (o := self._completion(c, params)) is not None]
        prompt_logprobs = None
        if params.prompt_logprobs is not None and (first or kind != OutputKind.DELTA):
            top = params.prompt_logprobs
            prompt_logprobs = [None] + [self.fake_logprobs(t, top) for t in prompt[1:]]
        return RequestOutput(
            request_id, None, prompt, outputs, finished, prompt_logprobs, 0, metrics
        )

    def _completion(self, choice: _Choice, params: SamplingParams) -> CompletionOutput | None:
        hold = 0
        if choice.finish_reason is None and params.stop and not params.include_stop_str_in_output:
            hold = max(len(s) for s in params.all_stop_strings) - 1
        visible = max(choice.sent_chars, len(choice.text) - hold)
        if params.output_kind != OutputKind.DELTA:
            return self._snapshot(choice, visible)
        if choice.sent_tokens == len(choice.token_ids) and choice.finish_reason is None:
            return None
        if choice.sent_tokens == len(choice.token_ids) and choice.sent_chars < 0:
            return None  # already sent the finish
        out = CompletionOutput(
            choice.index,
            choice.text[choice.sent_chars : visible],
            choice.token_ids[choice.sent_tokens :],
            None,
            choice.logprobs[choice.sent_tokens :] if params.logprobs is not None else None,
            choice.finish_reason,
            choice.stop_reason,
        )
        choice.sent_tokens, choice.sent_chars = len(choice.token_ids), visible
        if choice.finish_reason is not None:
            choice.sent_chars = -1  # nothing more for this choice
        return out

    def _snapshot(self, choice: _Choice, visible: int) -> CompletionOutput | None:
        choice.sent_tokens = len(choice.token_ids)
        return CompletionOutput(
            choice.index,
            choice.text[:visible],
            list(choice.token_ids),
            None,
            list(choice.logprobs) or None,
            choice.finish_reason,
            choice.stop_reason,
        )

    def _publish_stats(self) -> None:
        self._num_steps += 1
        if self.on_stats is not None:
            stats = SchedulerStats(num_running=len(self.in_flight), step_id=self._num_steps)
            self.on_stats(stats, "fake-0")


# --- a served gateway for the integration tests -----------------------------------------------


@contextlib.asynccontextmanager
async def serve_gateway(
    engine: FakeEngineClient | None = None, **app_options: Any
) -> AsyncIterator[tuple[str, FakeEngineClient]]:
    """A gateway over ``engine`` on a free loopback port: yields (base url, engine)."""
    from shoal.gateway.app import create_app
    from shoal.gateway.server import start_http_server

    engine = engine or FakeEngineClient()
    app = create_app(engine, served_model_name=engine.model_name, **app_options)
    server = await start_http_server(app, "127.0.0.1", 0)
    try:
        yield server.url, engine
    finally:
        await server.stop()


def make_fake_engine(bus: object, config: ShoalConfig) -> FakeEngineClient:
    """An engine factory as ``gateway.actor.GatewayActor(engine_factory=...)`` calls it."""
    return FakeEngineClient(max_model_len=config.model_config.max_model_len or 4096)


async def _serve_forever(port: int, token_delay: float, max_model_len: int) -> None:
    from shoal.gateway.app import create_app
    from shoal.gateway.server import serve_forever

    engine = FakeEngineClient(token_delay=token_delay, max_model_len=max_model_len)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await serve_forever(create_app(engine), "127.0.0.1", port, stop)


if __name__ == "__main__":  # a gateway over the fake engine, for bench/serve.py smoke runs
    parser = argparse.ArgumentParser(description="serve the gateway over the fake engine")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--max-model-len", type=int, default=4096)
    cli = parser.parse_args()
    asyncio.run(_serve_forever(cli.port, cli.token_delay, cli.max_model_len))
