"""The offline API, shaped like vLLM's: ``LLM(model, ...).generate(prompts, sampling_params)``.

Everything runs in this process on an in-memory bus: the workers, the engine core(s) and an
engine client live in one event loop on a background thread, and the blocking methods submit
work to it. A prompt is a string or ``{"prompt_token_ids": [...]}``; results come back in the
order of the prompts, each a ``RequestOutput`` with ``.outputs[i].text``, ``.token_ids`` and
``.finish_reason``. Without sampling parameters a request starts from the model's generation
config (``get_default_sampling_params``, as vLLM's).

A blocking call interrupted while it waits (Ctrl-C, or its future failing) cancels its work on
the loop thread and aborts its requests in the engine core before the exception goes on, so
nothing keeps generating behind the caller's back.

A script that ends without ``shutdown()`` still stops its LLMs cleanly: each is shut down when
the interpreter begins to exit, before the thread pools the workers run steps in refuse new
work (garbage collection at exit comes after that, when a step still in flight would fail).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import threading
import uuid
import weakref
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from shoal.bus import make_bus
from shoal.bus.messages.lora import LoRARequest
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.runtime.actor import Actor
from shoal.config.deployment import ShoalConfig
from shoal.deploy.deployment import build_config, plan_actors, start_in_process, stop_in_process
from shoal.deploy.progress import ProgressBar
from shoal.engine.client.chat_options import ChatOptions
from shoal.engine.client.engine_client import AsyncEngineClient
from shoal.engine.client.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput

T = TypeVar("T")
PromptInput = str | dict[str, Any]
_llm_counter = itertools.count()


def _shut_down_at_exit(llm: weakref.ref[LLM]) -> None:
    if (alive := llm()) is not None:
        alive.shutdown()


def _before_thread_pools_exit(callback: Any) -> None:
    """Call ``callback`` when the interpreter starts to exit, before ``concurrent.futures``'
    own hook stops every executor (hooks run newest first). ``threading._register_atexit`` is
    what ``concurrent.futures`` itself uses; plain ``atexit`` runs only after it."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # not CPython 3.9+: the closest there is
        import atexit

        atexit.register(callback)
    else:
        register(callback)


class LLM:
    """A model served in-process. Engine options use vLLM's names (any ``ShoalConfig`` option:
    ``max_num_seqs``, ``dtype``, ``enable_prefix_caching``, ``chat_template`` (a file or the
    template), ``generation_config``, ...), and a group's JSON as vLLM takes it:
    ``speculative_config={"method": "ngram", "num_speculative_tokens": 3}`` (or a
    ``SpeculativeConfig``), ``kv_transfer_config``, ``fault_tolerance_config``."""

    def __init__(
        self,
        model: str | None = None,
        *,
        config: ShoalConfig | None = None,
        startup_timeout_s: float = 600.0,
        **options: Any,
    ) -> None:
        """``LLM(model, **options)`` as in vLLM, or ``LLM(config=...)`` with a config built
        elsewhere (the in-memory bus, where everything here runs)."""
        if config is None:
            if model is None:
                raise TypeError(
                    "LLM needs a model (a Hugging Face directory, a GGUF file or a built-in "
                    "name such as 'smollm2-135m-instruct') or a config"
                )
            config = build_config(model=model, **{"bus": "memory", **options})
        elif model is not None or options:
            raise TypeError("give LLM a model and options, or a config, not both")
        elif config.bus_config.bus != "memory":
            raise ValueError("LLM runs every actor in this process: its config needs bus='memory'")
        self.config = config
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="shoal-llm", daemon=True
        )
        self._thread.start()
        self._actors: list[Actor] = []
        self._client: AsyncEngineClient | None = None
        self._request_counter = itertools.count()  # request ids, unique per LLM as in vLLM
        _before_thread_pools_exit(functools.partial(_shut_down_at_exit, weakref.ref(self)))
        try:
            self._client = self._run(self._start(startup_timeout_s))
        except BaseException:
            self.shutdown()
            raise

    # ----- lifecycle

    async def _start(self, timeout_s: float) -> AsyncEngineClient:
        bus = make_bus(f"memory://llm-{next(_llm_counter)}-{uuid.uuid4().hex[:6]}")
        await bus.connect()
        self._actors = await start_in_process(bus, plan_actors(self.config))
        client = AsyncEngineClient(bus, self.config)
        await client.start()
        await client.wait_until_ready(timeout_s, self.config.parallel_config.data_parallel_size)
        return client

    def shutdown(self) -> None:
        """Stop the actors and the loop thread (also on garbage collection)."""
        if not self._thread.is_alive():
            return
        try:
            self._run(self._stop(), timeout=60)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    async def _stop(self) -> None:
        if self._client is not None:
            await self._client.close()
        await stop_in_process(self._actors)
        self._actors.clear()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.shutdown()

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout)

    # ----- generation

    def get_tokenizer(self) -> Any:
        return self._require_client().tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters of a request given none: the model's generation config's
        recommendations (``--generation-config``), else SamplingParams' defaults."""
        return self._require_client().generation_defaults.sampling_params()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string or ``{"prompt_token_ids": [...]}``), each with
        ``lora_request``'s adapter (one for all, or one per prompt; needs ``enable_lora``)."""
        prompt_list = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        inputs = [_prompt_input(p) for p in prompt_list]
        params = self._params_per_prompt(sampling_params, len(inputs))
        return self._run_requests(inputs, params, use_tqdm, _per_prompt(lora_request, len(inputs)))

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding, pooled as the model's pooling config (or
        ``pooler_config``) says (vLLM's ``LLM.embed``; the model run with ``runner="pooling"``)."""
        if not self.config.model_config.is_pooling:
            raise ValueError("LLM.embed needs a pooling model: LLM(model, runner='pooling')")
        prompt_list = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        inputs = [_prompt_input(p) for p in prompt_list]
        loras = _per_prompt(lora_request, len(inputs))
        request_ids = [str(next(self._request_counter)) for _ in inputs]
        return self._run(self._embed_all(inputs, request_ids, loras, use_tqdm))

    async def _embed_all(
        self,
        inputs: list[str | list[int]],
        request_ids: list[str],
        loras: list[LoRARequest | None],
        use_tqdm: bool,
    ) -> list[EmbeddingRequestOutput]:
        client = self._require_client()
        progress = ProgressBar(len(inputs), enabled=use_tqdm, desc="Embedded prompts")

        async def one(index: int) -> EmbeddingRequestOutput:
            output = await client.embed(
                inputs[index], request_ids[index], lora_request=loras[index]
            )
            progress.update(output)
            if output.error is not None or output.pooled is None:
                raise RuntimeError(f"request {request_ids[index]} failed: {output.error}")
            embedding = EmbeddingOutput(output.pooled)
            return EmbeddingRequestOutput(output.request_id, output.prompt_token_ids, embedding)

        try:
            return list(await asyncio.gather(*(one(i) for i in range(len(inputs)))))
        finally:
            progress.close()

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template (``chat_template``'s text, else the served one) to each
        conversation, with vLLM's options, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        client = self._require_client()
        options = ChatOptions(
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )
        inputs: list[str | list[int]] = [
            client.encode_chat(list(conv), options)  # type: ignore[arg-type]
            for conv in conversations
        ]
        params = self._params_per_prompt(sampling_params, len(inputs))
        return self._run_requests(inputs, params, use_tqdm, _per_prompt(lora_request, len(inputs)))

    def _params_per_prompt(
        self, params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling params for {count} prompts")
        return list(params)

    def _run_requests(
        self,
        inputs: list[str | list[int]],
        params: list[SamplingParams],
        use_tqdm: bool,
        loras: list[LoRARequest | None],
    ) -> list[RequestOutput]:
        """Run the requests to the end; if the wait is interrupted, abort them in the engine."""
        request_ids = [str(next(self._request_counter)) for _ in inputs]
        future = asyncio.run_coroutine_threadsafe(
            self._generate_all(inputs, params, request_ids, use_tqdm, loras), self._loop
        )
        try:
            return future.result()
        except BaseException:
            future.cancel()
            with contextlib.suppress(Exception):
                self._run(self._abort(request_ids), timeout=30)
            raise

    async def _abort(self, request_ids: list[str]) -> None:
        client = self._require_client()
        for request_id in request_ids:
            await client.abort(request_id)  # idempotent: finished ids are ignored

    async def _generate_all(
        self,
        inputs: list[str | list[int]],
        params: list[SamplingParams],
        request_ids: list[str],
        use_tqdm: bool,
        loras: list[LoRARequest | None],
    ) -> list[RequestOutput]:
        client = self._require_client()
        progress = ProgressBar(len(inputs), enabled=use_tqdm, desc="Processed prompts")

        async def one(index: int) -> RequestOutput:
            final = None
            stream = client.generate(
                inputs[index], params[index], request_ids[index], lora_request=loras[index]
            )
            async for output in stream:
                final = output
            progress.update(final)
            assert final is not None
            return final

        try:
            return list(await asyncio.gather(*(one(i) for i in range(len(inputs)))))
        finally:
            progress.close()

    def _require_client(self) -> AsyncEngineClient:
        if self._client is None:
            raise RuntimeError("LLM is shut down")
        return self._client


def _per_prompt(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, count: int
) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    if len(lora_request) != count:
        raise ValueError(f"got {len(lora_request)} LoRA requests for {count} prompts")
    return list(lora_request)


def _prompt_input(prompt: PromptInput) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return [int(t) for t in prompt["prompt_token_ids"]]
    if isinstance(prompt, dict) and "prompt" in prompt:
        return str(prompt["prompt"])
    raise TypeError("a prompt is a string, {'prompt': str} or {'prompt_token_ids': [...]}")
