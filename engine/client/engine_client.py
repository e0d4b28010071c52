"""The engine client (shoal's AsyncLLM): tokenizes, routes each request to an engine core (by
load, or with ``routing_mode`` kv by its cached prefix too: ``prefix_routing.PrefixRouting``),
streams its outputs as ``outputs.RequestOutput`` and aborts it when the consumer goes away.

It listens on its own output subject for every engine core's ``EngineOutputs`` (fed to the pure
``OutputProcessor``, which detokenizes and applies stop strings) and ``RequestRejected``; on
engine stats, heartbeats and status events for routing (``EngineRouter``). Its requests in
flight (each one's collector, and which engine core and epoch it went to) are kept in
``placements.RequestPlacements``, shared with ``EngineFaults``.

Disaggregated prefill (``disagg_routing.DisaggRouting``): a long prompt goes to a prefill engine
core first; once its first token is back, the request continues on its decode engine core, which
pulls the held KV (``_hand_over``).

Requests their engine core will not finish (it stopped, died, restarted or went silent, or this
client's bus connection dropped; with ``enable_request_resumption`` also a ``resumable`` error or
an ``unavailable`` rejection) are left to ``engine_faults.EngineFaults``: it ends them with
finish reason "error" or, with resumption, resumes them on a ready engine core where the
caller's stream left off. With resumption, a request that finds every known engine core faulted
is parked to wait for one rather than refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from shoal.bus.base import Bus, Subscription
from shoal.bus.codec import Codec, DecodeError
from shoal.bus.errors import BusError
from shoal.bus.messages.engine import (
    EngineOutbound,
    EngineOutputs,
    EngineStats,
    KVTransferParams,
    RequestRejected,
    SchedulerStats,
)
from shoal.bus.messages.lora import LoRARequest
from shoal.bus.messages.pooling import PoolingParams
from shoal.bus.messages.sampling import OutputKind, SamplingParams, out_of_vocab
from shoal.bus.msg import Msg
from shoal.bus.runtime.liveness import watch_liveness
from shoal.bus.subjects import Subjects
from shoal.config.deployment import ShoalConfig
from shoal.engine.client.chat_options import ChatOptions
from shoal.engine.client.collector import RequestOutputCollector
from shoal.engine.client.disagg_routing import DisaggRouting, continued_params, prefill_params
from shoal.engine.client.engine_faults import EngineFaults
from shoal.engine.client.engine_sender import EngineSender
from shoal.engine.client.fault_tolerance import FaultTolerance
from shoal.engine.client.generation_defaults import GenerationDefaults, read_generation_defaults
from shoal.engine.client.interface import EngineUnavailableError, RequestValidationError
from shoal.engine.client.model_info import read_max_model_len, sentence_transformers_pooling
from shoal.engine.client.output_processor import ChildRequest, OutputProcessor, ResumeRequest
from shoal.engine.client.outputs import RequestOutput
from shoal.engine.client.placements import RequestPlacements
from shoal.engine.client.prefix_routing import PrefixRouting
from shoal.engine.client.request_trace import RequestTrace
from shoal.engine.client.resumption import Resumptions
from shoal.engine.client.router import EngineRouter
from shoal.engine.client.structured import check_structured_outputs
from shoal.engine.client.tokenizer import Tokenizer
from shoal.engine.client.vocabulary import Vocabulary, read_vocabulary
from shoal.tracing.setup import actor_tracer, close_tracer

if TYPE_CHECKING:
    from shoal.tracing.tracer import ActorTracer

log = logging.getLogger(__name__)

_OUTBOUND: Codec[EngineOutbound] = Codec(EngineOutbound)
_STATS: Codec[EngineStats] = Codec(EngineStats)

StatsListener = Callable[[SchedulerStats, str], None]


class AsyncEngineClient:
    """Implements ``engine.client.interface.EngineClientInterface`` over the bus."""

    def __init__(
        self,
        bus: Bus,
        config: ShoalConfig,
        *,
        client_id: str | None = None,
        engine_stale_after_s: float = 10.0,
    ) -> None:
        self.bus = bus
        model = config.model_config
        self.model_dir = model.model
        self.model_config = model
        self.subjects = Subjects(config.bus_config.namespace)
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:12]}"
        self._model_name = model.name
        self._max_model_len = model.max_model_len or read_max_model_len(Path(model.model))
        self.prefix_routing = (
            PrefixRouting(bus, self.subjects, config)
            if config.resolved_routing_mode == "kv"
            else None
        )
        self.router = EngineRouter(
            engine_stale_after_s,
            index=self.prefix_routing.index if self.prefix_routing is not None else None,
            load_weight=config.parallel_config.routing_load_weight,
        )
        self.fault_tolerance = FaultTolerance(bus, self.subjects, self.router)
        # Disaggregated prefill: which requests a prefill engine core prefills, and the decode
        # engine core each of those continues on.
        self.disagg = DisaggRouting(config.disaggregation_config, self.router)
        self.stats_listeners: list[StatsListener] = []
        self._tokenizer: Tokenizer | None = None
        self._vocabulary: Vocabulary | None = None
        self._generation_defaults = GenerationDefaults()
        self._processor: OutputProcessor | None = None
        self.placements = RequestPlacements()
        self._subs: list[Subscription] = []
        self._watchdog: asyncio.Task[None] | None = None
        self._stop_listening: Callable[[], None] | None = None
        self.resumptions = Resumptions(config.fault_tolerance_config)
        self._observability = config.observability_config
        self.tracer: ActorTracer | None = None  # with --otlp-traces-endpoint, once started
        self.sender = EngineSender(bus, self.subjects, self.client_id)
        # Lost, restarted, silent engine cores; resumption.
        self._faults = EngineFaults(
            self.router,
            self.fault_tolerance,
            self.resumptions,
            self.placements,
            self.sender,
            self.require_processor,
        )

    # ----- lifecycle

    async def start(self) -> AsyncEngineClient:
        await asyncio.get_running_loop().run_in_executor(None, self._read_model)
        self.tracer = actor_tracer(self._observability, "engine-client", self.client_id)
        self._processor = OutputProcessor(
            self.require_tokenizer(), resume_on_fault=self.resumptions.enabled
        )
        if not self.bus.is_connected:
            await self.bus.connect()
        s = self.subjects
        self._subs = [
            await self.bus.subscribe(
                s.engine_out(self.client_id), self._on_output, sequential=True
            ),
            await self.bus.subscribe(s.engine_stats("*"), self._on_stats),
            *await watch_liveness(
                self.bus, s, "engine", self.router.liveness, on_change=self._on_engine_change
            ),
        ]
        if self.prefix_routing is not None:  # replays the stream: a restart rebuilds the index
            await self.prefix_routing.start()
        self._stop_listening = self.bus.on_reconnect(self._faults.on_bus_reconnected)
        await self.bus.flush()
        self._watchdog = asyncio.create_task(self._faults.watch())
        return self

    def _read_model(self) -> None:
        """The tokenizer (with the served chat template), the vocabulary and the generation
        defaults, from the model directory; the defaults logged as vLLM does."""
        model, model_dir = self.model_config, Path(self.model_dir)
        tokenizer = Tokenizer.from_pretrained(
            model_dir, tokenizer_dir=model.tokenizer, chat_template=model.chat_template
        )
        self._vocabulary = read_vocabulary(tokenizer, model_dir)
        defaults = read_generation_defaults(model_dir, model.generation_config)
        if defaults:
            log.warning(
                "Default sampling parameters have been overridden by the model's generation "
                "config (%s): %s. If this is not intended, start with --generation-config vllm.",
                model.generation_config,
                defaults.describe(),
            )
        self._generation_defaults, self._tokenizer = defaults, tokenizer
        self.sender.eos_token_ids = tokenizer.eos_token_ids

    async def close(self) -> None:
        if self._stop_listening is not None:
            self._stop_listening()
            self._stop_listening = None
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
            self._watchdog = None
        for request_id in self.placements.request_ids():
            await self.abort(request_id)
        if self.prefix_routing is not None:
            await self.prefix_routing.stop()
        subs, self._subs = self._subs, []
        for sub in subs:
            with contextlib.suppress(BusError):
                await sub.unsubscribe()
        tracer, self.tracer = self.tracer, None
        await close_tracer(tracer)

    async def wait_until_ready(self, timeout_s: float, num_engines: int = 1) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.router.ready_engines()) < num_engines:
            if time.monotonic() > deadline:
                raise EngineUnavailableError(
                    f"{len(self.router.ready_engines())} of {num_engines} engine cores ready "
                    f"after {timeout_s:.0f} s"
                )
            await asyncio.sleep(0.05)

    # ----- EngineClientInterface protocol

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_model_len(self) -> int:
        reported = self.router.max_model_len()
        return min(self._max_model_len, reported) if reported else self._max_model_len

    @property
    def tokenizer(self) -> Any:
        return self.require_tokenizer().hf

    @property
    def vocabulary(self) -> Vocabulary:
        if self._vocabulary is None:
            raise RuntimeError("engine client not started")
        return self._vocabulary

    @property
    def generation_defaults(self) -> GenerationDefaults:
        return self._generation_defaults

    def require_tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise RuntimeError("engine client not started")
        return self._tokenizer

    def is_ready(self) -> bool:
        return bool(self.router.ready_engines())

    def accepts_requests(self) -> bool:
        return self.is_ready() or self._new_requests_wait()

    def _new_requests_wait(self) -> bool:
        """With resumption on, a request that finds every known engine core down waits for one
        as a cut request would (parked); with none known, or resumption off, it is refused."""
        return self.resumptions.enabled and bool(self.router.engines)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        options: ChatOptions | None = None,
        *,
        add_special_tokens: bool = False,
    ) -> list[int]:
        tokenizer = self.require_tokenizer()
        return tokenizer.encode_chat(messages, options, add_special_tokens=add_special_tokens)

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        trace = self._trace(request_id, sampling_params)
        collector = await self._add_traced(
            trace, prompt, sampling_params, request_id, priority=priority, lora_request=lora_request
        )
        finished = False
        try:
            while not finished:
                output = collector.get_nowait() or await collector.get()
                finished = output.finished
                if trace is not None:
                    trace.on_output(output)
                yield output
        except BaseException as exc:
            if trace is not None:
                trace.fail(exc)
            raise
        finally:
            if not finished:
                await self.abort(request_id)

    def _trace(self, request_id: str, params: SamplingParams) -> RequestTrace | None:
        """The request's ``llm_request`` span (None with tracing off)."""
        if self.tracer is None:
            return None
        return RequestTrace(self.tracer, request_id, params, self._model_name)

    async def _add_traced(
        self,
        trace: RequestTrace | None,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        **options: Any,
    ) -> RequestOutputCollector:
        """``add_request`` carrying ``trace``'s context; a request not added ends its span
        (and nothing is aborted: its id may be another request's)."""
        try:
            headers = None if trace is None else trace.headers
            return await self.add_request(
                prompt, params, request_id, trace_headers=headers, **options
            )
        except BaseException as exc:
            if trace is not None:
                trace.fail(exc)
            raise

    @functools.cached_property
    def pooling_params(self) -> PoolingParams:
        """How this model's embeddings are pooled: ``--pooler-config`` over the model's
        sentence-transformers config, else vLLM's default for a decoder (LAST, normalized)."""
        declared = sentence_transformers_pooling(Path(self.model_dir)) or {}
        given = {**declared, **(self.model_config.pooler_config or {})}
        try:
            return PoolingParams(**given)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            raise ValueError(f"pooler_config: {exc}") from None

    async def embed(
        self,
        prompt: str | list[int],
        request_id: str,
        *,
        lora_request: LoRARequest | None = None,
    ) -> RequestOutput:
        """The prompt's embedding (``RequestOutput.pooled``): its prefill, pooled."""
        params = SamplingParams(max_tokens=1, temperature=0.0, output_kind=OutputKind.FINAL_ONLY)
        trace = self._trace(request_id, params)
        collector = await self._add_traced(
            trace,
            prompt,
            params,
            request_id,
            lora_request=lora_request,
            pooling_params=self.pooling_params,
        )
        try:
            output = await collector.get()
        except BaseException as exc:
            if trace is not None:
                trace.fail(exc)
            await self.abort(request_id)
            raise
        if trace is not None:
            trace.on_output(output)
        return output

    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
        trace_headers: dict[str, str] | None = None,
    ) -> RequestOutputCollector:
        """Send a request to an engine core (run with ``lora_request``'s adapter; with
        ``pooling_params``, for its prompt's embedding; ``trace_headers``: its trace context,
        carried by its adds); its outputs arrive in the returned collector."""
        processor = self.require_processor()
        prompt_text, prompt_ids = self._tokenize(prompt)
        if invalid := out_of_vocab(params, self.vocabulary.model_vocab_size):
            raise RequestValidationError(invalid[1], invalid[0])
        if request_id in self.placements:
            raise RequestValidationError(f"request id {request_id!r} is already in flight")
        if params.structured_outputs is not None:  # a bad schema is the caller's mistake
            await check_structured_outputs(params.structured_outputs)
        routing, router = self.prefix_routing, self.router
        lora_name = None if lora_request is None else lora_request.lora_name
        hashes = (
            routing.request_hashes(prompt_ids, params, router.ready_engines, lora_name)
            if routing
            else []
        )
        engine = router.pick(
            block_hashes=hashes, num_requests=max(1, params.n), lora_name=lora_name
        )
        if engine is None and not self._new_requests_wait():
            raise EngineUnavailableError("no engine core is ready to take requests")
        arrival = time.time()
        children = processor.add_request(
            request_id,
            prompt_ids,
            params,
            prompt_text,
            arrival,
            priority,
            lora_request,
            pooling_params,
            trace_headers,
        )
        collector = RequestOutputCollector(params.output_kind)
        self.placements.track(request_id, collector)
        fresh: list[tuple[ChildRequest, list[int]]] = [(child, []) for child in children]
        payload = ResumeRequest(
            prompt_ids, arrival, priority, fresh, lora_request, pooling_params, trace_headers
        )
        if engine is None:
            self.resumptions.park(request_id, payload, None, time.monotonic(), counts=False)
            return collector
        kv_params = None
        prefill = self.disagg.prefill_engine(request_id, engine, len(prompt_ids), params, hashes)
        if prefill is not None:  # prefilled there, continued on ``engine``
            processor.mark_remote_prefill(request_id)
            prefilled: list[tuple[ChildRequest, list[int]]] = [
                (ChildRequest(c.request_id, prefill_params(c.sampling_params)), [])
                for c in children
            ]
            payload = dataclasses.replace(payload, children=prefilled)
            kv_params = KVTransferParams(do_remote_decode=True)
            engine = prefill
        self.placements.place(request_id, engine.engine_id, self.router.epoch(engine.engine_id))
        try:
            await self.sender.send_adds(engine.engine_id, payload, kv_params)
        except BusError as exc:
            self._fail(request_id, EngineUnavailableError(f"request not sent: {exc!r}"))
            raise EngineUnavailableError(f"request not sent to {engine.engine_id}: {exc}") from exc
        except BaseException as exc:  # e.g. a value the wire cannot encode, or a cancellation
            self._fail(request_id, exc if isinstance(exc, Exception) else RuntimeError(str(exc)))
            raise
        return collector

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            prompt_ids = self.require_tokenizer().encode(prompt)
            text: str | None = prompt
        else:
            prompt_ids, text = list(prompt), None
            if invalid := self.vocabulary.invalid_prompt_id(prompt_ids):
                raise RequestValidationError(invalid, "prompt")
        if not prompt_ids:
            raise RequestValidationError("the prompt must not be empty", "prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestValidationError(
                f"the prompt has {len(prompt_ids)} tokens; this model's maximum context length "
                f"is {self.max_model_len} tokens (prompt plus at least one generated token)",
                "prompt",
            )
        return text, prompt_ids

    async def abort(self, request_id: str) -> None:
        """Stop a request (idempotent): the engine core frees it, the caller gets no more."""
        _, engine_id, engine_ids = self._forget(request_id)
        if engine_id is not None and engine_ids:
            await self.sender.send_abort(engine_id, engine_ids)

    def _forget(
        self, request_id: str
    ) -> tuple[RequestOutputCollector | None, str | None, list[str]]:
        """Stop tracking a request: its collector, its engine core and the engine-side ids
        still running there."""
        self.resumptions.forget(request_id)
        self.disagg.forget(request_id)
        collector, engine_id = self.placements.untrack(request_id)
        return collector, engine_id, self.require_processor().abort_request(request_id)

    # ----- inbound

    def require_processor(self) -> OutputProcessor:
        if self._processor is None:
            raise RuntimeError("engine client not started")
        return self._processor

    async def _on_output(self, msg: Msg) -> None:
        try:
            message = _OUTBOUND.decode(msg.data)
        except DecodeError as exc:
            log.warning("undecodable engine output: %s", exc)
            return
        match message:
            case EngineOutputs():
                await self._on_engine_outputs(message)
            case RequestRejected():
                self._on_rejected(message)

    async def _on_engine_outputs(self, message: EngineOutputs) -> None:
        if message.stats is not None:
            self._notify_stats(message.stats, message.engine_id)
        processed = self.require_processor().process_outputs(message)
        for output in processed.request_outputs:
            collector = self.placements.collector(output.request_id)
            if collector is not None:
                collector.put(output)
        for request_id in processed.finished_request_ids:
            self.resumptions.forget(request_id)
            self.disagg.forget(request_id)
            self.placements.untrack(request_id)
        if processed.reqs_to_abort:
            await self.sender.send_abort(message.engine_id, processed.reqs_to_abort)
        for prefill_engine_id, engine_request_id in processed.to_release:
            await self.sender.send_release(prefill_engine_id, [engine_request_id])
        for request_id, held in processed.to_hand_over.items():
            await self._hand_over(request_id, held)
        for request_id, error in processed.to_resume.items():
            engine_id = message.engine_id
            self._faults.resume_or_fail(request_id, engine_id, f"engine core {engine_id}: {error}")

    async def _hand_over(self, request_id: str, held: KVTransferParams) -> None:
        """Continue a request prefilled remotely on its decode engine core (another ready one
        if that one is not), which pulls the KV ``held`` names; with none ready it is resumed
        or fails as after a fault, and the held KV is released."""
        processor = self.require_processor()
        payload = processor.continuation(request_id)
        engine = self.disagg.decode_engine(request_id)
        if payload is None or engine is None or request_id not in self.placements:
            await self.sender.send_release(
                held.remote_engine_id, processor.engine_request_ids(request_id) or [request_id]
            )
            if payload is not None:
                self._faults.resume_or_fail(
                    request_id,
                    held.remote_engine_id,
                    "no decode engine core is ready",
                    counts=False,
                )
            return
        pull = msgspec.structs.replace(held, do_remote_decode=False, do_remote_prefill=True)
        children = [
            (ChildRequest(c.request_id, continued_params(c.sampling_params)), tokens)
            for c, tokens in payload.children
        ]
        self.placements.place(request_id, engine.engine_id, self.router.epoch(engine.engine_id))
        try:
            continuation = dataclasses.replace(payload, children=children)
            await self.sender.send_adds(engine.engine_id, continuation, pull)
        except BusError as exc:
            await self.sender.send_release(
                held.remote_engine_id, [c.request_id for c, _ in children]
            )
            self._fail(request_id, EngineUnavailableError(f"request not handed over: {exc!r}"))

    def _on_rejected(self, rejected: RequestRejected) -> None:
        owner = self.require_processor().owner_of(rejected.request_id)
        if owner is None or owner not in self.placements:
            return
        if rejected.code == "unavailable" and self.resumptions.may_resume(owner, counts=False):
            engine_id = self.placements.engine_of(owner)
            self._faults.on_turned_away(owner, engine_id, rejected.message)
            return
        if rejected.code == "invalid":
            error: Exception = RequestValidationError(rejected.message)
        else:
            error = EngineUnavailableError(f"{rejected.code}: {rejected.message}")
        self._fail(owner, error)

    def _fail(self, request_id: str, error: Exception) -> None:
        collector, engine_id, engine_ids = self._forget(request_id)
        if engine_id is not None and engine_ids:
            self.sender.abort_later(engine_id, engine_ids)
        if collector is not None:
            collector.put(error)

    async def _on_stats(self, msg: Msg) -> None:
        try:
            stats = _STATS.decode(msg.data)
        except DecodeError:
            return
        if self.router.on_stats(stats):
            self._faults.check_engine(stats.engine_id)
            self._notify_stats(stats.stats, stats.engine_id)

    def _on_engine_change(self, engine_id: str) -> None:
        if self.prefix_routing is not None:
            self.prefix_routing.on_engine_change(engine_id, self.router.liveness)
        self._faults.check_engine(engine_id)

    def _notify_stats(self, stats: SchedulerStats, engine_id: str) -> None:
        for listener in self.stats_listeners:
            try:
                listener(stats, engine_id)
            except Exception:
                log.exception("stats listener failed")


async def make_client(bus: Bus, config: ShoalConfig) -> AsyncEngineClient:
    """A started client: the gateway actor's default engine factory."""
    return await AsyncEngineClient(bus, config).start()
