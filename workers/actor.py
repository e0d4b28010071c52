"""The worker actor: a thin asyncio shell that serves a model runner on the bus.

Inbox ``subjects.worker_in(worker_id)`` takes ``WorkerInbound`` messages one at a time, in
arrival order: ``ExecuteStep`` → ``StepResult``, ``ResetWorker`` → ``ResetDone``,
``DescribeWorker`` → ``WorkerInfo``, ``JoinGroup`` → ``GroupJoined``, ``InjectFault`` →
``FaultInjected``. The answer is the reply to a request; a step that arrives without a reply
subject has its result published on ``subjects.engine_results(engine_id)``.
With async scheduling the next step arrives while one runs: it waits in the inbox and runs
after it, on the tokens the runner sampled in the step before (``bus/messages/worker.py``).
Each ``StepResult`` says how long the worker sat idle before the step (``idle_before_s``).

Everything that touches the runner (load, execute, reset) runs in ONE dedicated thread, so the
event loop keeps sending heartbeats during a long prefill and the runner never sees two threads.
An exception in a step is answered with ``StepResult(error=StepError(...))`` naming the cause and
the step's requests, never with silence; the worker keeps serving.

Fatal and non-fatal step errors (``StepError.fatal``): an exception out of ``execute`` is
fatal, whatever raised it (the forward pass for the whole batch, a persistent batch that could
not be updated, a broken tensor-parallel group, an injected fault): the worker's state is
suspect, and with fault tolerance on the engine core's sentinel takes over. Only the runner
itself may answer ``fatal=False``, for errors confined to named requests' own inputs (a token
id outside the vocabulary, more tokens than ``max_model_len``: ``workers.rejections``); the
other requests of that step get their tokens. Not made non-fatal, as the runner cannot confine
them: a sampling or logits-processing failure (one batched kernel for every request), a cached
request the worker does not know, a full persistent batch (the worker and engine disagree).

Fault tolerance: ``JoinGroup(epoch)`` drops this rank's tensor-parallel group (or, with expert
parallelism, the group of every data-parallel rank's worker) and joins the epoch's new one
(``workers.group_ports``; the blocking part in the runner thread, so heartbeats go on) →
``GroupJoined``; ``InjectFault(after_steps)`` → ``FaultInjected(at_step)`` arms a fault:
the step with that count runs in full (tensor-parallel peers are never left waiting in a
collective) and is answered as if its forward pass had raised ``InjectedFault`` (fatal).

The runner contract (``StepRunner``): ``load() -> facts`` (num_blocks, block_size,
max_model_len, vocab_size, eos_token_ids; optionally the KV geometry num_layers, num_kv_heads,
head_dim, kv_dtype, total_kv_heads for KV offload), ``execute(step) -> StepResult``, ``reset()``;
optionally ``num_requests`` (else ``len(runner.batch)``), ``num_blocks_in_use``,
``num_split_steps`` (steps run as two micro-batches, with DBO) and ``tp``
(``.rank``/``.size``) for heartbeats and ``WorkerInfo``, and ``group`` (a ``GroupMember``, or
None when the group is static or there is none) for ``JoinGroup``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from shoal.bus.base import Bus
from shoal.bus.buckets import ObjectStore
from shoal.bus.codec import Codec, encode
from shoal.bus.errors import BusError
from shoal.bus.messages.control import ActorState
from shoal.bus.messages.fault import FaultInjected, InjectedFault, InjectFault
from shoal.bus.messages.structured import StepGrammar
from shoal.bus.messages.worker import (
    DescribeWorker,
    ExecuteStep,
    GroupJoined,
    JoinGroup,
    ResetDone,
    ResetWorker,
    StepError,
    StepResult,
    WorkerInbound,
    WorkerInfo,
)
from shoal.bus.msg import Msg
from shoal.bus.runtime.actor import Actor, Inbox
from shoal.config.deployment import ShoalConfig
from shoal.tracing.setup import actor_tracer, close_tracer
from shoal.workers.grammar_mask import GrammarMailbox
from shoal.workers.group_ports import (
    GroupMember,
    PortBoard,
    advertised_host,
    group_key,
    port_board_for,
    rejoin_group,
)
from shoal.workers.lora.folders import AdapterFolders, adapters_to_fetch
from shoal.workers.step_tracing import record_step

if TYPE_CHECKING:
    from shoal.tracing.tracer import ActorTracer

log = logging.getLogger(__name__)
T = TypeVar("T")
EXPERT_GROUP_OWNER = "experts"  # the key of the expert-parallel group (no engine id is one)


class RunnerFacts(Protocol):
    """What ``load`` reports (``workers.model_runner.ModelFacts``)."""

    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token_ids(self) -> list[int]: ...


class StepRunner(Protocol):
    """What the worker actor needs of a model runner (``workers.model_runner.ModelRunner``)."""

    def load(self) -> RunnerFacts: ...

    def execute(self, step: ExecuteStep) -> StepResult: ...

    def reset(self) -> None: ...


def num_requests_of(runner: StepRunner) -> int | None:
    """Requests in the runner's persistent batch (``num_requests``, else ``len(batch)``)."""
    count = getattr(runner, "num_requests", None)
    if count is None and getattr(runner, "batch", None) is not None:
        count = len(runner.batch)  # type: ignore[attr-defined]
    return None if count is None else int(count)


def execute_or_explain(
    runner: StepRunner, step: ExecuteStep, injected: str | None = None
) -> StepResult:
    """Run one step; an exception becomes a ``StepResult`` whose (fatal) error names cause and
    requests. ``injected``: the step runs, then fails with ``InjectedFault(injected)``.
    Sets ``execute_time_s``. Synchronous: called in the worker's runner thread."""
    started = time.perf_counter()
    try:
        result = runner.execute(step)
        if injected is not None:
            raise InjectedFault(injected)
    except Exception as exc:
        req_ids = step.batch_order().req_ids
        log.exception("step %d failed for requests %s", step.step_id, req_ids)
        message = f"step {step.step_id} failed in the model runner: {type(exc).__name__}: {exc}"
        result = StepResult(step_id=step.step_id, error=StepError(message, req_ids))
    result.execute_time_s = time.perf_counter() - started
    return result


class WorkerActor(Actor):
    """Serves one model runner: tensor-parallel rank ``tp_rank`` of data-parallel rank
    ``dp_rank`` of the deployment ``config`` (built and loaded in ``on_start``), or, in tests
    and embedded use, an injected ``runner``."""

    kind: ClassVar[str] = "worker"

    def __init__(
        self,
        bus: Bus,
        worker_id: str,
        *,
        config: ShoalConfig | None = None,
        tp_rank: int = 0,
        tp_init_method: str | None = None,
        runner: StepRunner | None = None,
        port_board: PortBoard | None = None,
        engine_id: str | None = None,
        dp_rank: int = 0,
        ep_init_method: str | None = None,
        namespace: str = "shoal",  # without a config (an injected runner); else the config's
        heartbeat_interval_s: float = 1.0,
        drain_timeout_s: float = 30.0,
    ) -> None:
        if runner is None and config is None:
            raise ValueError("WorkerActor needs a config or a runner")
        super().__init__(
            bus,
            worker_id,
            namespace=config.bus_config.namespace if config is not None else namespace,
            heartbeat_interval_s=heartbeat_interval_s,
            drain_timeout_s=drain_timeout_s,
        )
        self.worker_id = worker_id
        self.engine_id = engine_id
        self.runner: StepRunner | None = runner
        self.facts: RunnerFacts | None = None
        self.config = config
        self.tp_rank = tp_rank
        self.tp_init_method = tp_init_method
        self.dp_rank = dp_rank
        self.ep_init_method = ep_init_method  # the expert-parallel group's rendezvous, if any
        # where rank 0 hosts a new group
        self.group_host = advertised_host(ep_init_method or tp_init_method)
        self._port_board = port_board
        self._lora_store: ObjectStore | None = None  # the deployment's adapters, once needed
        self.group_epoch: str | None = None  # the epoch of the group this rank is in
        self._fault_at: tuple[int, str] | None = None  # (step count, message) of an armed fault
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"runner-{worker_id}")
        self._codec: Codec[WorkerInbound] = Codec(WorkerInbound)
        self.grammar_mailbox = GrammarMailbox()  # late grammar masks, for the runner
        self.num_steps = 0
        self.num_step_errors = 0
        self._step_running = False
        self._last_result_at: float | None = None  # perf_counter() when the last step ended
        self.bound_cores: list[int] | None = None  # where the runner's threads run (CPU)
        self.tracer: ActorTracer | None = None  # with --otlp-traces-endpoint

    # -- lifecycle -----------------------------------------------------------------------------
    def inboxes(self) -> Sequence[Inbox]:
        subject = self.subjects.worker_in(self.worker_id)
        late_masks = self.subjects.worker_grammar(self.worker_id)  # not behind a running step
        return [
            Inbox(subject, self._handle, self._codec, sequential=True),
            Inbox(late_masks, self._on_step_grammar, Codec(StepGrammar)),
        ]

    async def on_start(self) -> None:
        """Build (unless injected) and load the runner in the runner thread."""
        if self.config is not None:
            self.tracer = actor_tracer(self.config.observability_config, self.kind, self.worker_id)
        try:
            if self.runner is None:
                self.bound_cores = await self._in_runner_thread(self._bind_threads)
                self.runner = await self._in_runner_thread(self._build_runner)
            self.facts = await self._in_runner_thread(self.runner.load)
        except Exception as exc:
            await self.set_state(ActorState.DEAD, f"model runner failed to load: {exc!r}")
            raise

    async def on_stop(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if (close := getattr(self.runner, "close", None)) is not None:
            close()
        tracer, self.tracer = self.tracer, None
        await close_tracer(tracer)

    def served_engine(self) -> str:
        return self.engine_id or ""

    def load(self) -> dict[str, float]:
        figures = {
            "num_steps": float(self.num_steps),
            "num_step_errors": float(self.num_step_errors),
            "step_running": float(self._step_running),
        }
        if self.runner is not None and self.facts is not None:
            figures["num_blocks"] = float(self.facts.num_blocks)
            num_requests = num_requests_of(self.runner)
            if num_requests is not None:
                figures["num_requests"] = float(num_requests)
            for figure in ("num_blocks_in_use", "num_split_steps"):
                value = getattr(self.runner, figure, None)
                if value is not None:
                    figures[figure] = float(value)
        return figures

    # -- messages ------------------------------------------------------------------------------
    async def _on_step_grammar(self, message: StepGrammar, msg: Msg) -> None:
        self.grammar_mailbox.put(message.step_id, message.bitmask)

    async def _handle(self, message: WorkerInbound, msg: Msg) -> Any:
        match message:
            case ExecuteStep():
                return await self._execute(message, msg)
            case ResetWorker():
                await self._in_runner_thread(self._require_runner().reset)
                log.info("%r: reset (%s)", self, message.reason or "no reason given")
                return ResetDone(self.worker_id)
            case DescribeWorker():
                if message.engine_id and self.engine_id is None:
                    self.engine_id = message.engine_id
                return self.describe()
            case JoinGroup():
                return await self._join_group(message)
            case InjectFault():
                self._fault_at = (self.num_steps + message.after_steps, message.message)
                log.warning("%r: fault armed for step count %d", self, self._fault_at[0])
                return FaultInjected(self.worker_id, self._fault_at[0])
        raise TypeError(f"unexpected message {type(message).__name__}")

    async def _execute(self, step: ExecuteStep, msg: Msg) -> StepResult | None:
        runner = self._require_runner()
        await self._fetch_adapters(runner, step)
        self._step_running = True
        started, started_ns = time.perf_counter(), time.time_ns()
        injected = None
        if self._fault_at is not None and self._fault_at[0] == self.num_steps:
            injected, self._fault_at = self._fault_at[1], None
        try:
            result = await self._in_runner_thread(execute_or_explain, runner, step, injected)
        finally:
            self._step_running = False
            self._last_result_at, last = time.perf_counter(), self._last_result_at
        if last is not None:
            result.idle_before_s = started - last
        if self.tracer is not None and step.trace_parents:
            record_step(self.tracer, step, result, started_ns, time.time_ns())
        self.num_steps += 1
        self.num_step_errors += result.error is not None
        if msg.reply:
            return result
        await self._publish_result(result)
        return None

    async def _fetch_adapters(self, runner: StepRunner, step: ExecuteStep) -> None:
        """Fetch the object-store adapters of the step's new requests that this host has not
        (a failed fetch fails only their requests, when the runner cannot find the files)."""
        folders: AdapterFolders | None = getattr(runner, "lora_folders", None)
        if folders is None:
            return
        for lora in adapters_to_fetch(folders, step):
            try:
                if self._lora_store is None:
                    self._lora_store = await self.bus.open_object_store(self.subjects.lora_bucket())
                await folders.fetch(self._lora_store, lora)
                log.info("%r: fetched LoRA adapter %r", self, lora.lora_name)
            except (BusError, OSError, ValueError) as exc:
                log.error("%r: LoRA adapter %r not fetched: %s", self, lora.lora_name, exc)

    async def _publish_result(self, result: StepResult) -> None:
        if self.engine_id is None:
            log.error("%r: step %d has no reply subject and no engine_id", self, result.step_id)
            return
        try:
            await self.bus.publish(self.subjects.engine_results(self.engine_id), encode(result))
        except BusError:
            log.exception("%r: result of step %d not published", self, result.step_id)

    async def _join_group(self, message: JoinGroup) -> GroupJoined:
        """Leave this rank's group and join ``message.epoch``'s (raises if it cannot)."""
        member: GroupMember | None = getattr(self._require_runner(), "group", None)
        if member is None:
            if getattr(getattr(self.runner, "tp", None), "size", 1) > 1:
                raise RuntimeError(
                    f"worker {self.worker_id}: its tensor-parallel group is static "
                    "(fault tolerance is off) and cannot be rebuilt"
                )
            return GroupJoined(self.worker_id, message.epoch)  # alone: no group to join
        if self.engine_id is None:
            raise RuntimeError(f"worker {self.worker_id} has no engine id to key its group")
        self.group_epoch = None
        if self._port_board is None:
            replicas = self.config.bus_config.jetstream_replicas if self.config else 1
            self._port_board = port_board_for(self.bus, self.subjects, replicas=replicas)
        init_method = await rejoin_group(
            member,
            self._port_board,
            group_key(self._group_owner(), message.epoch),
            host=self.group_host,
            timeout_s=message.timeout_s,
            in_thread=self._in_runner_thread,
        )
        self.group_epoch = message.epoch
        log.info("%r: joined the group of epoch %s at %s", self, message.epoch, init_method)
        return GroupJoined(self.worker_id, message.epoch, init_method)

    def _group_owner(self) -> str:
        """Whose group this worker rebuilds: its engine core's tensor-parallel group, or the
        expert-parallel group of every data-parallel rank (one key for all of them)."""
        if self.config is not None and self.config.parallel_config.runs_in_lockstep:
            return EXPERT_GROUP_OWNER
        assert self.engine_id is not None
        return self.engine_id

    def describe(self) -> WorkerInfo:
        if self.facts is None:
            raise RuntimeError(f"worker {self.worker_id} has not loaded its model yet")
        tp = getattr(self.runner, "tp", None)
        export_ref = getattr(self.runner, "kv_export_ref", None)  # (a new epoch: see there)
        return WorkerInfo(
            worker_id=self.worker_id,
            num_blocks=self.facts.num_blocks,
            block_size=self.facts.block_size,
            max_model_len=self.facts.max_model_len,
            vocab_size=self.facts.vocab_size,
            eos_token_ids=list(self.facts.eos_token_ids),
            incarnation=self.incarnation,
            tp_rank=getattr(tp, "rank", 0),
            tp_size=getattr(tp, "size", 1),
            num_layers=getattr(self.facts, "num_layers", 0),
            num_kv_heads=getattr(self.facts, "num_kv_heads", 0),
            head_dim=getattr(self.facts, "head_dim", 0),
            kv_dtype=getattr(self.facts, "kv_dtype", ""),
            total_kv_heads=getattr(self.facts, "total_kv_heads", 0),
            kv_export=export_ref() if export_ref is not None else None,
        )

    # -- helpers -------------------------------------------------------------------------------
    async def _in_runner_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _bind_threads(self) -> list[int] | None:
        """Pin the runner thread's torch threads to this worker's cores (CPU workers only)."""
        from shoal.workers.thread_binding import WorkerSlot, bind_worker_threads  # torch

        assert self.config is not None
        if not self.config.model_config.device.startswith("cpu"):
            return None
        parallel = self.config.parallel_config
        slot = WorkerSlot(
            tp_rank=self.tp_rank,
            tp_size=parallel.tensor_parallel_size,
            dp_rank=self.dp_rank,
            dp_size=parallel.data_parallel_size,
            shares_process=self.config.bus_config.bus == "memory",
        )
        return bind_worker_threads(parallel.cpu_threads_bind, slot)

    def _build_runner(self) -> StepRunner:
        from shoal.workers.model_runner import ModelRunner  # heavy imports only where a model runs

        assert self.config is not None
        runner = ModelRunner(
            self.config,
            tp_rank=self.tp_rank,
            tp_init_method=self.tp_init_method,
            dp_rank=self.dp_rank,
            ep_init_method=self.ep_init_method,
        )
        runner.grammar_mailbox = self.grammar_mailbox  # late grammar masks reach it here
        runner.grammar_wait_s = self.config.parallel_config.step_timeout_s
        return runner

    def _require_runner(self) -> StepRunner:
        if self.runner is None:
            raise RuntimeError(f"worker {self.worker_id} has no model runner (not started)")
        return self.runner
