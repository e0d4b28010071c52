"""The deployment's configuration: one document, built once from the command line or ``LLM(...)``
and carried whole to every actor (as JSON to actor processes), in vLLM's grouping.

``ShoalConfig`` holds one struct per concern: ``ModelConfig`` (what to serve), ``CacheConfig``
(the paged KV cache), ``SchedulerConfig`` (what one step may carry, in what order),
``ParallelConfig`` (engine cores, workers per engine core, how long an engine core waits for
them), ``BusConfig`` (the transport and namespace), ``FaultToleranceConfig`` (what happens
when an engine core or a worker fails), ``KVTransferConfig`` (KV offload to tier actors;
``kv_transfer.py``, with its translation from vLLM's JSON) and ``SpeculativeConfig``
(speculative decoding; ``speculative.py``, likewise). A later subsystem adds its own group as
one more struct and one more field.

Option names are unique across groups, so a flat ``max_num_seqs=64`` (a CLI flag's dest, an
``LLM`` keyword) finds its group by name: ``ShoalConfig.from_options(model=..., **options)``.
Invalid values raise ``ValueError`` naming the option, on construction and on decoding. Every
group is keyword-only, immutable and strict about unknown fields.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from shoal.config.disaggregation import DisaggregationConfig
from shoal.config.kv_transfer import (
    FsTierConfig,
    KVTransferConfig,
    ObjTierConfig,
    P2PTierConfig,
    kv_offload_options,
)
from shoal.config.lora import LoRAConfig, lora_modules
from shoal.config.observability import ObservabilityConfig
from shoal.config.speculative import SpeculativeConfig, speculative_options
from shoal.config.validation import one_of as _one_of
from shoal.config.validation import positive as _positive
from shoal.config.validation import require as _require

DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZATION_METHODS = ("int8", "int4")  # weight-only, at load (workers.layers.weight_quantizing)
POLICIES = ("fcfs", "priority")
HASH_ALGOS = ("sha256", "xxhash")
BUS_KINDS = ("nats", "memory")
ROUTING_MODES = ("kv", "load")
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")  # gateway.tool_parsers has each
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # gateway.reasoning splits each
RUNNERS = ("generate", "pooling")
CONVERTS = ("auto", "embed")
MAX_BLOCK_SIZE = 128
GENERATION_CONFIG_AUTO = "auto"  # the model's generation_config.json (vLLM's default)
GENERATION_CONFIG_NONE = "vllm"  # no defaults from any generation_config.json (vLLM's spelling)
NUM_UBATCHES = 2  # micro-batches of a DBO step


class ModelConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """What to serve and how: the local HF directory, its name, dtype, context and seed."""

    model: str  # a local Hugging Face directory (config.json, *.safetensors, tokenizer files)
    served_model_name: str | None = None  # what clients call it (default: the path)
    dtype: str = "auto"  # auto: bf16 on CUDA and on CPUs with bf16 units, else fp32 (cpu_info)
    max_model_len: int | None = None  # default: the model's own context length
    seed: int = 0
    device: str = "cpu"  # cpu, cuda or cuda:N
    # Tool calling (the gateway's): parse calls out of the output when tool_choice is "auto".
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # one of TOOL_CALL_PARSERS
    # Reasoning models (vLLM's --reasoning-parser): <think>...</think> as reasoning_content.
    reasoning_parser: str | None = None  # one of REASONING_PARSERS
    # A Hugging Face tokenizer directory used instead of the model's (vLLM's --tokenizer).
    tokenizer: str | None = None
    # The chat template's text (vLLM's --chat-template; the launcher reads a file path into it),
    # used instead of the tokenizer's own. None: the tokenizer's.
    chat_template: str | None = None
    # Whether a request may bring its own chat template (vLLM's --trust-request-chat-template).
    trust_request_chat_template: bool = False
    # Default sampling parameters (vLLM's --generation-config): "auto" (the model directory's
    # generation_config.json), "vllm" (none), or a directory holding a generation_config.json.
    generation_config: str = GENERATION_CONFIG_AUTO
    # Weight-only quantization of the linear weights at load, on the CPU (vLLM's
    # --quantization): "int8" (a scale per group of 32 input values, as GGUF Q8_0) or "int4"
    # (a scale and a minimum per group of 32, as Q4_1; the LM head in int8). None: the
    # checkpoint's own (a GGUF file's Q4_0/Q4_1/Q8_0 weights stay quantized, every other weight
    # in ``dtype``).
    quantization: str | None = None
    # Load a GGUF file's quantized weights as floats in ``dtype`` (shoal's path before weights
    # were kept quantized); ``quantization`` then applies to every linear weight.
    dequantize: bool = False
    # CUDA graphs for decode steps (workers.cuda_graphs), on by default on CUDA: vLLM's
    # --enforce-eager turns them off; cuda_graph_sizes are the batch sizes captured (default: 1,
    # 2, 4 and every multiple of 8 up to max_num_seqs, at most 512).
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] | None = None
    # What the model is run for (vLLM's --runner / --convert): "generate" (completions and chat)
    # or "pooling" (embeddings: /v1/embeddings, LLM.embed); convert "embed" implies pooling.
    runner: str = "generate"
    convert: str = "auto"
    # How embeddings are pooled (vLLM's --pooler-config JSON: pooling_type LAST|MEAN|CLS,
    # normalize); None: the model's sentence-transformers config, else LAST, normalized.
    pooler_config: dict[str, Any] | None = None
    # vLLM's --structured-outputs-config JSON: enable_in_reasoning (a grammar constrains a
    # reasoning model's thinking too; by default it applies after the thinking) and backend
    # (xgrammar, shoal's one; "auto" names it too).
    structured_outputs_config: dict[str, Any] | None = None

    @property
    def is_pooling(self) -> bool:
        return self.runner == "pooling" or self.convert == "embed"

    @property
    def structured_in_reasoning(self) -> bool:
        return bool((self.structured_outputs_config or {}).get("enable_in_reasoning", False))

    def __post_init__(self) -> None:
        _one_of(self.dtype, DTYPES, "dtype")
        _one_of(self.runner, RUNNERS, "runner")
        _one_of(self.convert, CONVERTS, "convert")
        if self.quantization is not None:
            _one_of(self.quantization, QUANTIZATION_METHODS, "quantization")
            _require(
                not self.device.startswith("cuda"),
                "quantization",
                f"{self.quantization} runs torch's CPU kernels: use it with device cpu",
            )
        if self.tool_call_parser is not None:
            _one_of(self.tool_call_parser, TOOL_CALL_PARSERS, "tool_call_parser")
        if self.reasoning_parser is not None:
            _one_of(self.reasoning_parser, REASONING_PARSERS, "reasoning_parser")
        _check_structured_outputs_config(self.structured_outputs_config or {})
        _require(
            not self.enable_auto_tool_choice or self.tool_call_parser is not None,
            "enable_auto_tool_choice",
            "needs tool_call_parser (which format the model writes its calls in)",
        )
        _positive(self, "max_model_len")
        _require(
            self.cuda_graph_sizes is None or all(n > 0 for n in self.cuda_graph_sizes),
            "cuda_graph_sizes",
            f"must be positive batch sizes, got {self.cuda_graph_sizes}",
        )
        _require(self.seed >= 0, "seed", f"must be non-negative, got {self.seed}")
        _require(
            bool(self.generation_config),
            "generation_config",
            f"must be {GENERATION_CONFIG_AUTO}, {GENERATION_CONFIG_NONE} or a directory",
        )

    @property
    def name(self) -> str:
        """The served model name."""
        return self.served_model_name or self.model


STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar")


def _check_structured_outputs_config(options: dict[str, Any]) -> None:
    field = "structured_outputs_config"
    unknown = sorted(set(options) - {"enable_in_reasoning", "backend"})
    _require(not unknown, field, f"has no options {unknown} (enable_in_reasoning, backend)")
    in_reasoning = options.get("enable_in_reasoning", False)
    _require(
        isinstance(in_reasoning, bool),
        field,
        f"enable_in_reasoning must be true or false, got {in_reasoning!r}",
    )
    _one_of(options.get("backend", "auto"), STRUCTURED_OUTPUTS_BACKENDS, f"{field}.backend")


class CacheConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The paged KV cache: block size, how many blocks, prefix caching."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    kv_cache_memory_bytes: int | None = None  # KV cache bytes per worker (default: measured)
    num_gpu_blocks_override: int | None = None  # exact block count per worker

    def __post_init__(self) -> None:
        size = self.block_size
        _require(
            1 <= size <= MAX_BLOCK_SIZE and size & (size - 1) == 0,
            "block_size",
            f"must be a power of two up to {MAX_BLOCK_SIZE}, got {size}",
        )
        _one_of(self.prefix_caching_hash_algo, HASH_ALGOS, "prefix_caching_hash_algo")
        _positive(self, "kv_cache_memory_bytes")
        blocks = self.num_gpu_blocks_override
        # Block 0 is the null block, so a usable pool needs at least two.
        _require(
            blocks is None or blocks >= 2,
            "num_gpu_blocks_override",
            f"must be at least 2, got {blocks}",
        )


class SchedulerConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How many tokens and sequences one step may carry, and in what order requests run."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_num_scheduled_tokens: int | None = None  # None: max_num_batched_tokens
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: off; ignored when one request is eligible
    scheduling_policy: str = "fcfs"
    scheduler_reserve_full_isl: bool = True  # admit only if the whole prompt's blocks fit
    watermark: float = 0.0  # fraction of blocks kept free when admitting waiting requests
    max_waiting_requests: int = 1024  # past this an engine core answers "overloaded"
    # Schedule and send step N+1 while step N runs (output placeholders, two steps in flight;
    # vLLM's name and default).
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        _positive(self, "max_num_batched_tokens", "max_num_seqs", "max_waiting_requests")
        if self.max_num_scheduled_tokens is not None:
            _require(
                1 <= self.max_num_scheduled_tokens <= self.max_num_batched_tokens,
                "max_num_scheduled_tokens",
                f"must be in [1, max_num_batched_tokens={self.max_num_batched_tokens}], "
                f"got {self.max_num_scheduled_tokens}",
            )
        _require(
            self.long_prefill_token_threshold >= 0,
            "long_prefill_token_threshold",
            f"must be non-negative, got {self.long_prefill_token_threshold}",
        )
        _one_of(self.scheduling_policy, POLICIES, "scheduling_policy")
        _require(
            0.0 <= self.watermark < 1.0, "watermark", f"must be in [0, 1), got {self.watermark}"
        )

    @property
    def token_budget(self) -> int:
        """Tokens one step may schedule."""
        return self.max_num_scheduled_tokens or self.max_num_batched_tokens


_CORE_LIST = r"\d+(-\d+)?(,\d+(-\d+)?)*"
CPU_THREADS_BIND = re.compile(rf"auto|nobind|{_CORE_LIST}(\|{_CORE_LIST})*")


class ParallelConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Engine cores (data parallel), workers per engine core (tensor parallel), how long an
    engine core waits for its workers, and MoE scale-out (vLLM's names): with
    ``enable_expert_parallel`` the experts of every MoE layer are spread over the workers of
    all data-parallel ranks (one expert-parallel group) and the engine cores run their steps in
    lock-step; ``enable_dbo`` splits a step into two micro-batches when every rank has at least
    the threshold's tokens for its kind (a uniform decode, or any other batch)."""

    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    step_timeout_s: float = 120.0  # a worker step taking longer than this counts as failed
    worker_dead_after_s: float = 5.0  # a worker silent this long counts as dead
    enable_expert_parallel: bool = False
    enable_dbo: bool = False
    dbo_decode_token_threshold: int = 32
    dbo_prefill_token_threshold: int = 512
    # Which engine core takes a request: "kv" (the longest cached prefix, weighed against
    # load: score = cached blocks - routing_load_weight * load), "load" (the least loaded), or
    # None: kv when prefix caching is on and there are several engine cores to choose from
    # (``ShoalConfig.resolved_routing_mode``). In kv mode each engine core also publishes a
    # full snapshot of its prefix cache every ``kv_events_snapshot_interval_s``, so lost
    # events heal within one interval and the stream always holds a recent snapshot.
    routing_mode: str | None = None
    routing_load_weight: float = 1.0
    # CPU workers' cores (vLLM's VLLM_CPU_OMP_THREADS_BIND): "auto", "nobind" or one core list
    # per worker, "0-3|4-7" (workers.thread_binding)
    cpu_threads_bind: str = "auto"
    kv_events_snapshot_interval_s: float = 30.0

    def __post_init__(self) -> None:
        _positive(self, "data_parallel_size", "tensor_parallel_size")
        if self.routing_mode is not None:
            _one_of(self.routing_mode, ROUTING_MODES, "routing_mode")
        _require(
            CPU_THREADS_BIND.fullmatch(self.cpu_threads_bind) is not None,
            "cpu_threads_bind",
            f"must be auto, nobind or core lists per worker like 0-3|4-7, got "
            f"{self.cpu_threads_bind!r}",
        )
        _require(
            self.routing_load_weight >= 0,
            "routing_load_weight",
            f"must be non-negative, got {self.routing_load_weight}",
        )
        for option in ("step_timeout_s", "worker_dead_after_s", "kv_events_snapshot_interval_s"):
            value = getattr(self, option)
            _require(value > 0, option, f"must be positive, got {value}")
        for option in ("dbo_decode_token_threshold", "dbo_prefill_token_threshold"):
            value = getattr(self, option)
            _require(value >= NUM_UBATCHES, option, f"must be at least {NUM_UBATCHES}, got {value}")
        _require(
            not self.enable_dbo or self.enable_expert_parallel,
            "enable_dbo",
            "overlaps the expert all-to-all: it needs enable_expert_parallel",
        )
        _require(
            not self.enable_expert_parallel or self.tensor_parallel_size == 1,
            "enable_expert_parallel",
            "spreads experts over data-parallel ranks only: use tensor_parallel_size 1 "
            "(scale out with data_parallel_size)",
        )

    @property
    def expert_parallel_size(self) -> int:
        """Workers sharing the experts (1: each holds them all)."""
        return self.data_parallel_size if self.enable_expert_parallel else 1

    @property
    def runs_in_lockstep(self) -> bool:
        """Whether the engine cores must run every step together (a collective spans them)."""
        return self.expert_parallel_size > 1


MAX_JETSTREAM_REPLICAS = 5  # JetStream's own limit


class BusConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The transport the actors share and the namespace of their subjects."""

    bus: str = "nats"  # nats: actors as processes; memory: everything in one process
    # join this NATS deployment (default: an embedded server); a cluster's nodes comma-joined
    nats_url: str | None = None
    namespace: str = "shoal"  # subject prefix, so deployments can share a NATS cluster
    # copies of each JetStream bucket and stream shoal creates (3 in a 3-node cluster: survives
    # losing a node); at most the cluster's size, 1 for a single server
    jetstream_replicas: int = 1

    def __post_init__(self) -> None:
        _one_of(self.bus, BUS_KINDS, "bus")
        _require(
            1 <= self.jetstream_replicas <= MAX_JETSTREAM_REPLICAS,
            "jetstream_replicas",
            f"must be 1 to {MAX_JETSTREAM_REPLICAS}, got {self.jetstream_replicas}",
        )


class FaultToleranceConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Engine-core fault tolerance (vLLM's ``--enable-fault-tolerance`` and
    ``--fault-tolerance-config``, whose JSON sets any field here and turns it on).

    On (shoal's default; vLLM's is off, see docs/fault-tolerance.md): an engine core that faults
    aborts its requests, reports UNHEALTHY or DEAD with the fault and waits up to
    ``engine_recovery_timeout_sec`` for a ``retry`` command, else exits so its supervisor
    restarts it; the recovery controller sends that retry (unless turned off, for an operator to
    drive recovery by hand), and the engine client resumes the aborted requests on a healthy
    engine core (unless turned off: then they end with a clean error). Off
    (``--no-enable-fault-tolerance``): an engine core fails its requests and waits for its
    workers.
    """

    enable_fault_tolerance: bool = True
    engine_recovery_timeout_sec: int = 120
    # The engine client: resume requests cut by a fault on a healthy engine core, each at most
    # ``max_request_resumptions`` times and waiting at most ``request_resume_timeout_s`` for one.
    enable_request_resumption: bool = True
    max_request_resumptions: int = 3
    request_resume_timeout_s: float = 60.0
    # The recovery controller: retries per fault, with exponential backoff between them.
    enable_recovery_controller: bool = True
    recovery_max_retries: int = 5
    recovery_backoff_s: float = 0.5
    recovery_max_backoff_s: float = 10.0

    def __post_init__(self) -> None:
        _positive(self, "engine_recovery_timeout_sec", "recovery_max_retries")
        _require(
            self.max_request_resumptions >= 0,
            "max_request_resumptions",
            f"must be non-negative, got {self.max_request_resumptions}",
        )
        for option in ("request_resume_timeout_s", "recovery_backoff_s", "recovery_max_backoff_s"):
            value = getattr(self, option)
            _require(value > 0, option, f"must be positive, got {value}")


class ShoalConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Every group of the deployment's configuration (vLLM's ``VllmConfig``)."""

    model_config: ModelConfig
    cache_config: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    bus_config: BusConfig = msgspec.field(default_factory=BusConfig)
    fault_tolerance_config: FaultToleranceConfig = msgspec.field(
        default_factory=FaultToleranceConfig
    )
    kv_transfer_config: KVTransferConfig = msgspec.field(default_factory=KVTransferConfig)
    speculative_config: SpeculativeConfig = msgspec.field(default_factory=SpeculativeConfig)
    disaggregation_config: DisaggregationConfig = msgspec.field(
        default_factory=DisaggregationConfig
    )
    lora_config: LoRAConfig = msgspec.field(default_factory=LoRAConfig)
    observability_config: ObservabilityConfig = msgspec.field(default_factory=ObservabilityConfig)

    def __post_init__(self) -> None:
        _require(
            self.bus_config.bus != "memory" or self.parallel_config.tensor_parallel_size == 1,
            "tensor_parallel_size",
            "> 1 runs one worker process per rank, which the in-memory bus cannot reach: "
            "use the NATS bus",
        )
        _require(
            self.bus_config.bus != "memory" or not self.parallel_config.runs_in_lockstep,
            "enable_expert_parallel",
            "with data_parallel_size > 1 runs one worker process per rank, which the in-memory "
            "bus cannot reach: use the NATS bus",
        )
        _require(
            not self.kv_transfer_config.enabled or self.cache_config.enable_prefix_caching,
            "kv_transfer_config",
            "(KV offload) needs enable_prefix_caching: its keys are the prefix cache's hashes",
        )
        _require(
            not self.lora_config.enable_lora or not self.parallel_config.enable_expert_parallel,
            "enable_lora",
            "does not combine with enable_expert_parallel (its steps run split in micro-batches)",
        )
        _require(
            self.parallel_config.routing_mode != "kv" or self.cache_config.enable_prefix_caching,
            "routing_mode",
            "kv routes by the prefix cache's blocks: it needs enable_prefix_caching",
        )
        disagg = self.disaggregation_config
        _require(
            disagg.num_prefill == 0
            or disagg.num_prefill + disagg.num_decode == self.parallel_config.data_parallel_size,
            "num_prefill",
            f"+ num_decode must equal data_parallel_size "
            f"({self.parallel_config.data_parallel_size}), got {disagg.num_prefill} + "
            f"{disagg.num_decode}",
        )

    @property
    def resolved_routing_mode(self) -> str:
        """The routing mode in force: the one set, else kv with prefix caching on and more than
        one engine core (with one there is nothing to choose: no events, no prompt hashing)."""
        mode = self.parallel_config.routing_mode
        if mode is not None:
            return mode
        several = self.parallel_config.data_parallel_size > 1
        return "kv" if self.cache_config.enable_prefix_caching and several else "load"

    @classmethod
    def from_options(cls, **options: Any) -> ShoalConfig:
        """A config from flat options (``model=..., max_num_seqs=64, bus="memory"``); a name
        that no group has is a ``ValueError`` listing the known ones. ``fault_tolerance_config``
        (a dict, as vLLM's JSON flag) sets that group's fields and turns fault tolerance on;
        ``kv_transfer_config`` (vLLM's JSON) or ``kv_offloading_size`` (GiB) turns KV offload on
        (``kv_offload_options``); ``speculative_config`` (vLLM's JSON) sets speculative
        decoding. Flat options given beside a group's JSON win over it."""
        ft = options.pop("fault_tolerance_config", None)
        if ft is not None:
            options = {**fault_tolerance_options(ft), **options}
        kv = kv_offload_options(
            options.pop("kv_transfer_config", None),
            options.pop("kv_offloading_size", None),
            options.pop("kv_offloading_backend", "native"),
            cache_block_size=options.get("block_size") or CacheConfig().block_size,
        )
        spec = options.pop("speculative_config", None)
        if spec is not None:
            options = {**speculative_options(spec), **options}
        options = {**kv, **options}
        if options.get("lora_modules"):
            options["lora_modules"] = lora_modules(options["lora_modules"])
        if options.get("num_prefill") and options.get("data_parallel_size") in (None, 1):
            # local mode's engine cores are the prefill and decode ones
            options["data_parallel_size"] = options["num_prefill"] + options.get("num_decode", 0)
        by_group: dict[str, dict[str, Any]] = {name: {} for name in GROUPS}
        for option, value in options.items():
            group = OPTION_GROUPS.get(option)
            if group is None:
                known = ", ".join(sorted(OPTION_GROUPS))
                raise ValueError(f"unknown engine option {option!r}; known options: {known}")
            by_group[group][option] = value
        groups: dict[str, Any] = {name: GROUPS[name](**v) for name, v in by_group.items()}
        return cls(**groups)

    def replace(self, **options: Any) -> ShoalConfig:
        """A copy with some flat options changed; a group's JSON (``kv_transfer_config``,
        ``fault_tolerance_config``, ``speculative_config``, or the ``kv_offloading_size``
        shortcut) replaces that whole group."""
        current = self.to_options()
        whole = {name for name in GROUPS if name in options}
        if options.get("kv_offloading_size") is not None:
            whole.add("kv_transfer_config")
        for name in whole:
            for option in GROUPS[name].__struct_fields__:
                del current[option]
        return ShoalConfig.from_options(**{**current, **options})

    def to_options(self) -> dict[str, Any]:
        """The flat options this config was built from (``from_options``'s inverse)."""
        options: dict[str, Any] = {}
        for name in GROUPS:
            options.update(msgspec.structs.asdict(getattr(self, name)))
        return options


def fault_tolerance_options(value: dict[str, Any] | FaultToleranceConfig) -> dict[str, Any]:
    """Flat options from ``--fault-tolerance-config`` / ``LLM(fault_tolerance_config=...)``:
    passing it turns fault tolerance on unless it says otherwise."""
    if isinstance(value, FaultToleranceConfig):
        return msgspec.structs.asdict(value)
    if not isinstance(value, dict):
        raise ValueError(f"fault_tolerance_config must be a JSON object, got {value!r}")
    unknown = sorted(set(value) - set(FaultToleranceConfig.__struct_fields__))
    _require(not unknown, "fault_tolerance_config", f"has unknown fields: {', '.join(unknown)}")
    return {"enable_fault_tolerance": True, **value}


# --kv-transfer-config in vLLM's spelling. vLLM keys shoal's offload has no use for are "not
# supported" (so a vLLM config that relies on them fails loudly); other keys are "unknown".
GROUPS: dict[str, type[msgspec.Struct]] = {
    "model_config": ModelConfig,
    "cache_config": CacheConfig,
    "scheduler_config": SchedulerConfig,
    "parallel_config": ParallelConfig,
    "bus_config": BusConfig,
    "fault_tolerance_config": FaultToleranceConfig,
    "kv_transfer_config": KVTransferConfig,
    "speculative_config": SpeculativeConfig,
    "disaggregation_config": DisaggregationConfig,
    "lora_config": LoRAConfig,
    "observability_config": ObservabilityConfig,
}
OPTION_GROUPS: dict[str, str] = {
    field: group for group, struct in GROUPS.items() for field in struct.__struct_fields__
}

__all__ = [
    "GROUPS",
    "OPTION_GROUPS",
    "QUANTIZATION_METHODS",
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "BusConfig",
    "CacheConfig",
    "DisaggregationConfig",
    "FaultToleranceConfig",
    "FsTierConfig",
    "KVTransferConfig",
    "LoRAConfig",
    "ModelConfig",
    "ObjTierConfig",
    "ObservabilityConfig",
    "P2PTierConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "ShoalConfig",
    "SpeculativeConfig",
    "fault_tolerance_options",
]
