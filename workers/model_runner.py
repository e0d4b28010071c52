"""The model runner: loads a checkpoint, owns the paged KV cache and the persistent batch, and
turns each ``ExecuteStep`` diff into a ``StepResult`` (one forward over the flattened batch of
prefill chunks and decodes, then batched sampling).

Synchronous and single-threaded: the worker actor calls ``execute`` from its forward thread and
turns an exception into a ``StepError``. With tensor parallelism every rank runs the same steps;
rank 0's sampled tokens are broadcast so the ranks never diverge.

KV offload: a step's ``kv_transfers`` run right after its diff, before the forward pass
(``workers.kv_transfer``); a step may carry only transfers. A request whose load failed is left
out (the engine core recomputes it), the same on every rank: with tensor parallelism the ranks
agree on the failed jobs (one all-reduce, only in a step with copies) before any copy.

Speculative decoding (``config.speculative_config``): ``workers.spec_decode.spec_step`` places
each step's drafts, verifies them (only in a step where some request has drafts: otherwise the
plain sampling path runs), keeps the worker's own computed counts and proposes the next drafts.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from shoal.bus.messages.engine import Logprobs
from shoal.bus.messages.kv_handover import KVExportRef
from shoal.bus.messages.offload import KVTransferResult
from shoal.bus.messages.structured import GrammarBitmask
from shoal.bus.messages.worker import ExecuteStep, NewRequestData, StepResult
from shoal.bus.transport.data_address import data_address
from shoal.config.deployment import ShoalConfig
from shoal.config.peft_adapter import LoRAAdapterError
from shoal.kernels import ops
from shoal.workers.config import CheckpointConfig, resolve_dtype
from shoal.workers.cuda_graphs import (
    DecodeGraphs,
    GraphCapture,
    capture_cuda_graph,
    default_capture_sizes,
)
from shoal.workers.grammar_mask import GrammarMailbox, apply_grammar_bitmask
from shoal.workers.input_batch import InputBatch, StepInputs
from shoal.workers.kv_cache import bytes_per_block, num_blocks_for_budget
from shoal.workers.kv_canonical import CanonicalMapping
from shoal.workers.kv_export import ExportedKVCache, ExportViews, allocate_kv_cache
from shoal.workers.kv_export_server import KVExportServer
from shoal.workers.kv_pull import run_kv_pulls
from shoal.workers.kv_transfer import DroppedLoads, RegionViews, dtype_name, run_kv_transfers
from shoal.workers.layers.attention import AttentionMetadata
from shoal.workers.layers.weight_packing import pack_linear_weights
from shoal.workers.loader import load_model
from shoal.workers.lora.folders import AdapterFolders
from shoal.workers.lora.manager import LoRAManager
from shoal.workers.models.decoder import DecoderForCausalLM
from shoal.workers.moe.ep_step import ExpertParallelStep, join_expert_parallel
from shoal.workers.parallel import TPContext, init_tensor_parallel, rebuildable_group
from shoal.workers.pooling import Pooler
from shoal.workers.rejections import Rejections
from shoal.workers.request_store import RequestStore
from shoal.workers.runner_facts import ModelFacts, StepTimings
from shoal.workers.sampler import Sampler, compute_prompt_logprobs
from shoal.workers.sampling_metadata import SamplingBatch
from shoal.workers.spec_decode.factory import make_proposer, proposer_bytes_per_block
from shoal.workers.spec_decode.spec_step import SpecDecoder

log = logging.getLogger(__name__)
DEFAULT_CPU_KV_BYTES = 1 << 30


class ModelRunner:
    def __init__(
        self,
        config: ShoalConfig,
        *,
        tp_rank: int = 0,
        tp_init_method: str | None = None,
        progress: bool | None = None,
        dp_rank: int = 0,
        ep_init_method: str | None = None,
    ) -> None:
        """Serves ``config.model_config.model`` as tensor-parallel rank ``tp_rank``.
        ``tp_init_method`` (``tcp://host:port``, the same on every rank) joins the
        tensor-parallel group in ``load`` unless the process already joined one. With fault
        tolerance on, ``load`` joins no group: ``group`` (a ``TPGroup``) joins one per epoch
        when the worker is told to (``JoinGroup``), and can leave it for a new one. With
        expert parallelism, ``load`` joins the group of every data-parallel rank's worker at
        ``ep_init_method`` as rank ``dp_rank`` (``workers.moe.ep_step``)."""
        self.config = config
        self.model_dir = Path(config.model_config.model)
        self.dtype = resolve_dtype(config.model_config.dtype, config.model_config.device)
        self.device = torch.device(config.model_config.device)
        self.block_size = config.cache_config.block_size
        self.max_num_batched_tokens = config.scheduler_config.max_num_batched_tokens
        self.tp = TPContext(rank=tp_rank, size=config.parallel_config.tensor_parallel_size)
        self.group = rebuildable_group(config, tp_rank, dp_rank, str(self.device))
        self.tp_init_method = tp_init_method
        self.progress = progress
        self.timings = StepTimings()
        self.facts: ModelFacts | None = None
        self._model: DecoderForCausalLM | None = None
        self._sampler = Sampler()
        # Late grammar masks (async scheduling; the worker actor delivers them) and how long a
        # step waits for its own after its forward pass.
        self.grammar_mailbox: GrammarMailbox | None = None
        self.grammar_wait_s = 60.0
        self.regions = RegionViews()  # CPU tier regions, mapped for KV offload copies
        # Disaggregated prefill: this cache shared for remote decodes to pull (CPU workers of a
        # disaggregated deployment), and the prefill workers' caches this one pulls from.
        self.kv_export: ExportedKVCache | None = None
        self.kv_server: KVExportServer | None = None  # its reads for other hosts
        self.remote_caches = ExportViews()
        self._dropped = DroppedLoads()  # requests out of the batch after a failed KV load
        self.spec: SpecDecoder | None = None  # speculative decoding, when enabled
        self.dp_rank = dp_rank
        self.ep_init_method = ep_init_method
        self.ep_step: ExpertParallelStep | None = None  # with expert parallelism across DP
        self.gemm_backend = ""  # the linear layers' matmul (kernels.gemm), set by ``load``
        # Decode steps as CUDA graphs (``workers.cuda_graphs``): how to capture one (None: no
        # graphs; tests on the CPU put in a capture that replays by calling the forward), and
        # the captured graphs once ``load`` made them.
        self.graph_capture: GraphCapture | None = (
            capture_cuda_graph if self.device.type == "cuda" else None
        )
        self.graphs: DecodeGraphs | None = None
        self.lora: LoRAManager | None = None  # adapters and their slots (enable_lora)
        self.lora_folders = AdapterFolders()  # where adapters' files are (the actor fetches)
        self.pooler = Pooler()  # embeddings of pooling requests, as their prefills run

    # ---- loading -------------------------------------------------------------------------

    def load(self) -> ModelFacts:
        """Load the weights, allocate the KV cache, and return the model's facts."""
        torch.manual_seed(self.config.model_config.seed)
        if self.tp.size > 1 and self.group is None:
            self._join_tp_group()
        cfg = CheckpointConfig.from_dir(self.model_dir)
        max_model_len = self._max_model_len(cfg)
        self.ep_step = join_expert_parallel(
            self.config,
            self.dp_rank,
            self.ep_init_method if self.group is None else None,  # rebuildable: on JoinGroup
            self.device,
        )
        model, cfg = load_model(
            self.model_dir,
            dtype=self.dtype,
            device=self.device,
            tp=self.tp,
            max_positions=max_model_len,
            progress=self.progress,
            ep=self.ep_step.ep if self.ep_step is not None else None,
            quantization=self.config.model_config.quantization,
            dequantize=self.config.model_config.dequantize,
        )
        if self.tp.rank == 0:
            log.info("%s: linear weights: %s", self.model_dir.name, model.linear_weights)
        self.gemm_backend = pack_linear_weights(model, self.device, self.dtype)
        if self.config.lora_config.enable_lora:
            self.lora = LoRAManager(
                model, self.config.lora_config, self.dtype, self.device, self.lora_folders
            )
        if self.device.type == "cpu":
            ops.build_cpu_kernels()  # now rather than in the first step
        num_kv_heads = model.attention_layers()[0].num_kv_heads
        num_blocks = self._allocate_kv_cache(model, cfg, num_kv_heads)
        self._model = model
        self._build_batch(cfg, max_model_len, num_blocks)
        self.graphs = self._capture_graphs(max_model_len)
        self.facts = ModelFacts(
            num_blocks=num_blocks,
            block_size=self.block_size,
            max_model_len=max_model_len,
            vocab_size=cfg.vocab_size,
            eos_token_ids=list(cfg.eos_token_ids),
            num_layers=cfg.num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=cfg.head_dim,
            kv_dtype=dtype_name(self.dtype),
            total_kv_heads=cfg.num_kv_heads,
            linear_weights=model.linear_weights,
        )
        return self.facts

    def _allocate_kv_cache(
        self, model: DecoderForCausalLM, cfg: CheckpointConfig, num_kv_heads: int
    ) -> int:
        """Size the paged KV cache (a draft model's KV counted per block), allocate it, bind
        each attention layer's pages; the number of blocks."""
        block_bytes = bytes_per_block(
            num_layers=cfg.num_layers,
            block_size=self.block_size,
            num_kv_heads=num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=self.dtype,
        ) + proposer_bytes_per_block(self.config, self.dtype)
        num_blocks = self.config.cache_config.num_gpu_blocks_override or num_blocks_for_budget(
            self._kv_budget_bytes(), block_bytes
        )
        exported = self.config.disaggregation_config.enabled and self.device.type == "cpu"
        self.kv_export, self.kv_cache = allocate_kv_cache(
            exported=exported,
            device=self.device,
            num_layers=cfg.num_layers,
            num_blocks=num_blocks,
            block_size=self.block_size,
            num_kv_heads=num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=self.dtype,
        )
        if self.kv_export is not None:  # served to decode workers on other hosts too
            data_host = self.config.disaggregation_config.kv_data_host
            self.kv_server = KVExportServer(self.kv_export, *data_address(data_host))
        for layer, k, v in zip(
            model.attention_layers(), self.kv_cache.k, self.kv_cache.v, strict=True
        ):
            layer.bind_cache(k, v)
        return num_blocks

    def _build_batch(self, cfg: CheckpointConfig, max_model_len: int, num_blocks: int) -> None:
        """The persistent batch, its sampling state and input checks, and the speculative
        decoder when enabled."""
        self.requests = RequestStore(
            max_num_reqs=self.config.scheduler_config.max_num_seqs,
            vocab_size=cfg.vocab_size,
            device=self.device,
        )
        self.batch = InputBatch(
            self.requests, max_model_len=max_model_len, block_size=self.block_size
        )
        self.sampling = SamplingBatch(self.requests)
        self.rejections = Rejections(cfg.vocab_size, max_model_len)
        if self.config.speculative_config.enabled:
            proposer = make_proposer(
                self.config,
                num_blocks=num_blocks,
                block_size=self.block_size,
                max_model_len=max_model_len,
                vocab_size=cfg.vocab_size,
                device=self.device,
                dtype=self.dtype,
            )
            self.spec = SpecDecoder(
                proposer,
                batch=self.batch,
                sampling=self.sampling,
                tp=self.tp,
            )

    def _capture_graphs(self, max_model_len: int) -> DecodeGraphs | None:
        """Decode steps' CUDA graphs, captured now; None with ``enforce_eager``, without a
        capture (the CPU), with tensor or expert parallelism (their collectives are not
        captured), or when the capture fails (logged: every step then runs eagerly)."""
        model_config = self.config.model_config
        if (
            self.graph_capture is None
            or self.lora is not None  # (each step's adapters: not in a captured graph)
            or model_config.enforce_eager
            or self.tp.size > 1
            or self.ep_step is not None
        ):
            return None
        sizes = model_config.cuda_graph_sizes or default_capture_sizes(
            self.config.scheduler_config.max_num_seqs
        )
        graphs = DecodeGraphs(
            self.model.forward,
            sizes=sizes,
            max_blocks_per_seq=self.batch.block_table.shape[1],
            max_model_len=max_model_len,
            device=self.device,
            capture=self.graph_capture,
        )
        started = time.perf_counter()
        try:
            graphs.capture_all()
        except Exception:
            log.exception("capturing CUDA graphs failed: every step runs eagerly")
            return None
        log.info(
            "captured %d decode graphs (batch sizes %d..%d) in %.1f s",
            len(graphs.sizes),
            graphs.sizes[0],
            graphs.max_size,
            time.perf_counter() - started,
        )
        return graphs

    def _join_tp_group(self) -> None:
        if torch.distributed.is_initialized():
            return
        if self.tp_init_method is None:
            raise RuntimeError(
                f"tp_size={self.tp.size}: pass tp_init_method or call "
                "workers.parallel.init_tensor_parallel before load()"
            )
        init_tensor_parallel(
            self.tp.rank, self.tp.size, self.tp_init_method, device=str(self.device)
        )

    def _max_model_len(self, cfg: CheckpointConfig) -> int:
        limit = cfg.max_position_embeddings
        if cfg.sliding_window:  # attention here is full: stay inside the window
            limit = min(limit, cfg.sliding_window)
        requested = self.config.model_config.max_model_len
        if requested is None:
            return limit
        if requested > limit:
            raise ValueError(
                f"max_model_len={requested} exceeds the model's limit of {limit} positions"
            )
        return requested

    def _kv_budget_bytes(self) -> int:
        if self.config.cache_config.kv_cache_memory_bytes is not None:
            return self.config.cache_config.kv_cache_memory_bytes
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.8)
        return DEFAULT_CPU_KV_BYTES

    @property
    def num_requests(self) -> int:
        """Requests in the persistent batch."""
        return len(self.batch) if self._model is not None else 0

    @property
    def num_split_steps(self) -> int | None:
        """Steps run as two micro-batches (None: not in an expert-parallel group)."""
        return self.ep_step.num_split_steps if self.ep_step is not None else None

    @property
    def model(self) -> DecoderForCausalLM:
        if self._model is None:
            raise RuntimeError("ModelRunner.load() has not been called")
        return self._model

    # ---- one step ------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, step: ExecuteStep) -> StepResult:
        """Apply the diff, run the batch, sample; raises on a bad step (the shell reports it as
        fatal). Requests refused for their own inputs (``workers.rejections``) are left out and
        named in a non-fatal ``StepError``; the others run. A step of an expert-parallel round
        that fails before its collectives still runs them (on no tokens), so the other ranks
        are not left waiting."""
        if self.ep_step is None or not step.lockstep:
            return self._execute(step)
        self.ep_step.begin_round()
        try:
            return self._execute(step)
        except Exception:
            try:
                self.ep_step.end_failed_round(self.model)
            except Exception:  # a broken group: the step's own error is the one to report
                log.exception("after a failed step, its collectives failed too")
            raise

    def _execute(self, step: ExecuteStep) -> StepResult:
        started = time.perf_counter()
        t0 = started
        self.timings = StepTimings()
        self._apply_diff(step)
        transfer = self._run_kv_transfers(step)
        scheduled = step.batch_order()
        refused = self.rejections.error(step.step_id, scheduled.req_ids)
        req_ids, num_scheduled = scheduled
        if refused is not None or self._dropped:
            kept = [
                i
                for i, r in enumerate(req_ids)
                if r not in self.rejections and r not in self._dropped
            ]
            req_ids, num_scheduled = [req_ids[i] for i in kept], [num_scheduled[i] for i in kept]
        if not req_ids:
            if step.lockstep and self.ep_step is not None:
                self.ep_step.run_idle(self.model)  # the group's collectives need this rank
            return StepResult(step_id=step.step_id, error=refused, kv_transfer=transfer)
        if self.ep_step is not None and not step.lockstep:
            raise RuntimeError(
                f"step {step.step_id} has tokens but is not a lock-step round: the other "
                "expert-parallel ranks would not join its collectives"
            )
        if sum(num_scheduled) > self.max_num_batched_tokens:
            raise ValueError(
                f"step {step.step_id} schedules {sum(num_scheduled)} tokens, more "
                f"than max_num_batched_tokens={self.max_num_batched_tokens}"
            )
        spec = self.spec
        num_drafts = spec.num_drafts(req_ids) if spec is not None else None
        inputs = self.batch.prepare_inputs(req_ids, num_scheduled, num_drafts)
        if self.lora is not None:
            self.lora.prepare([self.requests[r].lora for r in req_ids], inputs.num_scheduled)
        t1 = time.perf_counter()
        try:
            hidden = self._forward(inputs, expert_parallel=True)  # [T, hidden]
        finally:
            if self.lora is not None:
                self.lora.end_step()
        sampling_idx = np.flatnonzero(inputs.is_sampling)  # [R] rows of the batch
        if spec is not None and spec.verifies(inputs, sampling_idx):
            t2 = time.perf_counter()
            grammar = self._step_grammar(step)
            sampled, logprobs = spec.verify(
                inputs, sampling_idx, hidden, self.model.compute_logits, grammar
            )
        else:
            logits_rows = torch.from_numpy(inputs.query_start_loc[1:][sampling_idx] - 1).long()
            logits = self.model.compute_logits(hidden[logits_rows.to(self.device)])  # [R, V]
            if (grammar := self._step_grammar(step)) is not None:
                row_of = {inputs.req_ids[i]: row for row, i in enumerate(sampling_idx)}
                apply_grammar_bitmask(logits, row_of, grammar)
            t2 = time.perf_counter()
            sampled, logprobs = self._sample(inputs, sampling_idx, logits)
        prompt_logprobs = self._prompt_logprobs(inputs, hidden)
        pooled = self.pooler.pool(inputs, hidden) if self.pooler else []
        self.batch.advance(inputs)
        spec_ids = spec.finish(inputs, sampling_idx, step.num_spec_tokens) if spec else []
        t3 = time.perf_counter()
        self.timings = StepTimings(prepare_s=t1 - t0, forward_s=t2 - t1, sample_s=t3 - t2)
        return StepResult(
            step_id=step.step_id,
            req_ids=req_ids,
            sampled_token_ids=sampled,
            logprobs=logprobs if any(lp is not None for lp in logprobs) else [],
            prompt_logprobs=prompt_logprobs,
            error=refused,
            execute_time_s=t3 - started,
            kv_transfer=transfer,
            spec_token_ids=spec_ids,
            pooled=pooled,
        )

    def _step_grammar(self, step: ExecuteStep) -> GrammarBitmask | None:
        """The step's grammar masks: carried by the step, or sent after it (async scheduling:
        awaited here, once the forward pass has run)."""
        if not step.grammar_later:
            return step.grammar
        if self.grammar_mailbox is None:
            raise RuntimeError(f"step {step.step_id} waits for grammar masks nobody delivers")
        return self.grammar_mailbox.take(step.step_id, self.grammar_wait_s)

    def _apply_diff(self, step: ExecuteStep) -> None:
        if self.spec is not None:
            self.spec.begin_step()
        for req_id in [*step.finished_req_ids, *step.preempted_req_ids]:
            self.pooler.forget(req_id)
        for req_id in step.finished_req_ids:
            self.batch.remove_request(req_id)
        for req_id in step.preempted_req_ids:
            if req_id not in self._dropped:  # a dropped one is out already, generator parked
                self.batch.remove_request(req_id, preempted=True)  # a seeded generator is kept
        self.rejections.forget([*step.finished_req_ids, *step.preempted_req_ids])
        if self._dropped:
            self._dropped.forget([*step.finished_req_ids, *step.preempted_req_ids])
            self._dropped.forget(new.req_id for new in step.new_requests)
        for new in step.new_requests:
            if not self.rejections.admit(new) or not self._admit_adapter(new):
                self.batch.remove_request(new.req_id)  # an earlier request of that id is gone
                continue
            added = self.batch.add_request(
                new.req_id,
                new.prompt_token_ids,
                new.block_ids,
                new.num_computed_tokens,
                new.sampling_params,
                output_token_ids=new.output_token_ids,
                eos_token_ids=new.eos_token_ids,
                resumed=new.resumed,
                lora=new.lora,
            )
            if self.spec is not None:
                self.spec.add_request(added)
            if new.pooling is not None:
                self.pooler.begin(new.req_id, new.pooling)
        for cached in step.cached_requests:
            if cached.req_id in self.rejections or cached.req_id in self._dropped:
                continue  # refused, or out after a failed KV load: left out of the step
            state = self.requests.get(cached.req_id)
            if state is None:
                raise KeyError(
                    f"request {cached.req_id!r} is not in the worker's batch "
                    "(sent as cached before it was sent as new)"
                )
            self.batch.append_blocks(state.row, cached.new_block_ids)
            if self.spec is None:
                self.batch.num_computed[state.row] = cached.num_computed_tokens
            else:  # the worker's own count (drafts' rejections), and the drafts to verify
                self.spec.take_cached(state, cached)

    def _admit_adapter(self, new: NewRequestData) -> bool:
        """Read a new request's adapter into host memory now (a bad one refuses the request
        alone, named in the step's non-fatal error)."""
        if new.lora is None:
            return True
        if self.lora is None:
            reason = f"asks for LoRA adapter {new.lora.lora_name!r}; this worker serves none"
        else:
            try:
                self.lora.read(new.lora)
                return True
            except LoRAAdapterError as exc:
                reason = f"LoRA adapter {new.lora.lora_name!r}: {exc}"
        self.rejections.refuse(new.req_id, reason)
        return False

    def _run_kv_transfers(self, step: ExecuteStep) -> KVTransferResult | None:
        """Run the step's KV offload copies (``workers.kv_transfer``) and remote prefills' pulls
        (``workers.kv_pull``) before anything reads the KV. A request whose load or pull failed
        leaves the batch (its generator parked, as when preempted) and stays out of this step
        and of any step naming it as cached, until the engine core finishes, preempts or
        re-sends it: the engine core recomputes it."""
        result = None
        if step.kv_transfers is not None:
            result = run_kv_transfers(
                step.kv_transfers,
                self.kv_cache,
                tp_rank=self.tp.rank,
                tp_size=self.tp.size,
                regions=self.regions,
                agree=self._agree_failures if self.tp.size > 1 else None,
            )
            self._drop_failed(result.failed_load_req_ids)
        if step.kv_pulls:
            assert self.facts is not None
            pulled = run_kv_pulls(
                step.kv_pulls,
                self.kv_cache,
                mine=CanonicalMapping.of(self.facts.total_kv_heads, self.tp.size, self.tp.rank),
                views=self.remote_caches,
                agree=self._agree_failures if self.tp.size > 1 else None,
            )
            self._drop_failed(pulled.failed_req_ids)
            result = result or KVTransferResult()
            result.failed_pull_req_ids = pulled.failed_req_ids
            result.num_pull_bytes = pulled.num_bytes
            result.pull_time_s = pulled.seconds
        return result

    def _drop_failed(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self.batch.remove_request(req_id, preempted=True)
            self._dropped.add(req_id)

    def kv_export_ref(self) -> KVExportRef | None:
        """This cache as remote decodes find it, in a new epoch (None: not exported). Asked
        once per engine core handshake: KV that an earlier engine core life held is void."""
        if self.kv_export is None or self.facts is None:
            return None
        self.kv_export.advance_epoch()
        return self.kv_export.ref(
            tp_rank=self.tp.rank,
            tp_size=self.tp.size,
            total_kv_heads=self.facts.total_kv_heads,
            dtype=self.facts.kv_dtype,
            address=self.kv_server.address if self.kv_server is not None else "",
        )

    def _agree_failures(self, failed: list[bool]) -> list[bool]:
        """Per-job KV copy failures of every rank: a job fails if it fails on any."""
        flags = torch.tensor(failed, dtype=torch.int32, device=self.device)
        return [bool(flag) for flag in self.tp.any_rank(flags).tolist()]

    def close(self) -> None:
        """Stop serving the exported KV cache (the worker stops)."""
        if self.kv_server is not None:
            self.kv_server.close()
            self.kv_server = None

    def reset(self) -> None:
        """Forget every request (after an engine core restart)."""
        self.batch.clear()
        self.rejections.clear()
        self._dropped.clear()

    def prepare_metadata(self, inputs: StepInputs) -> AttentionMetadata:
        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(self.device, non_blocking=True)

        return AttentionMetadata(
            slot_mapping=dev(inputs.slot_mapping),
            block_tables=dev(inputs.block_tables),
            query_start_loc=dev(inputs.query_start_loc),
            seq_lens=dev(inputs.seq_lens),
            max_query_len=inputs.max_query_len,
            max_seq_len=inputs.max_seq_len,
        )

    def _forward(self, inputs: StepInputs, expert_parallel: bool = False) -> torch.Tensor:
        """The model over the step's tokens: a step of decodes through its CUDA graph when one
        was captured (``workers.cuda_graphs``); a step of an expert-parallel round through
        ``ExpertParallelStep`` (which may split it into micro-batches)."""
        if self.graphs is not None and self.graphs.fits(inputs):
            return self.graphs.run(inputs)
        meta = self.prepare_metadata(inputs)
        input_ids = torch.from_numpy(inputs.input_ids).to(self.device, non_blocking=True)
        positions = torch.from_numpy(inputs.positions).to(self.device, non_blocking=True)
        if expert_parallel and self.ep_step is not None:
            return self.ep_step.forward(self.model, input_ids, positions, meta, inputs)
        return self.model(input_ids, positions, meta)

    @torch.inference_mode()
    def forward_only(self, inputs: StepInputs) -> torch.Tensor:
        """The bare model forward plus logits of the sampling rows (for benchmarks)."""
        hidden = self._forward(inputs)
        rows = torch.from_numpy(inputs.query_start_loc[1:] - 1).long().to(self.device)
        return self.model.compute_logits(hidden[rows])

    def _sample(
        self, inputs: StepInputs, sampling_idx: np.ndarray, logits: torch.Tensor
    ) -> tuple[list[list[int]], list[Logprobs | None]]:
        num_reqs = len(inputs.req_ids)
        sampled: list[list[int]] = [[] for _ in range(num_reqs)]
        logprobs: list[Logprobs | None] = [None] * num_reqs
        if len(sampling_idx) == 0:
            return sampled, logprobs
        sampling_ids = [inputs.req_ids[i] for i in sampling_idx]
        metadata = self.sampling.prepare(sampling_ids)
        output = self._sampler(logits, metadata)
        tokens = self.tp.broadcast_tokens(output.sampled_token_ids.contiguous())
        token_list = tokens.tolist()
        self.batch.append_token(inputs.rows[sampling_idx], np.asarray(token_list, np.int64))
        wire = (
            output.logprobs.to_wire_rows(metadata.num_logprobs)
            if output.logprobs is not None
            else [None] * len(sampling_idx)
        )
        requests = self.requests
        for i, req_id, token, lp in zip(sampling_idx, sampling_ids, token_list, wire, strict=True):
            sampled[i] = [token]
            logprobs[i] = lp
            requests[req_id].output_token_ids.append(token)
        return sampled, logprobs

    def _prompt_logprobs(self, inputs: StepInputs, hidden: torch.Tensor) -> list[Logprobs | None]:
        """Rows for prompt positions ``p + 1`` of this chunk (the first prompt token has none)."""
        out: list[Logprobs | None] = [None] * len(inputs.req_ids)
        for i, req_id in enumerate(inputs.req_ids):
            state = self.requests[req_id]
            num = state.sampling_params.prompt_logprobs
            if num is None or state.resumed:
                continue
            begin = int(inputs.num_computed[i])
            end = min(begin + int(inputs.num_scheduled[i]), state.num_prompt_tokens - 1)
            if end <= begin:
                continue
            first = int(inputs.query_start_loc[i])
            logits = self.model.compute_logits(hidden[first : first + end - begin])
            targets = torch.from_numpy(self.batch.token_ids[state.row, begin + 1 : end + 1])
            out[i] = compute_prompt_logprobs(logits, targets.to(logits.device), num).to_wire(num)
        return out if any(lp is not None for lp in out) else []
