"""The ``shoal`` command line's engine flags, in vLLM's spelling where they mean the same.

Each flag's destination is the name of a ``ShoalConfig`` option and its default is read from
that option's struct, so adding a flag means one ``_option`` line here, one config field and
the code that uses it. ``config_from_namespace`` turns the parsed flags into the config.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import msgspec

from shoal.bus.nats_ops.credentials import redact_url, url_has_secret
from shoal.config.deployment import (
    BUS_KINDS,
    CONVERTS,
    DTYPES,
    GROUPS,
    OPTION_GROUPS,
    POLICIES,
    QUANTIZATION_METHODS,
    REASONING_PARSERS,
    ROUTING_MODES,
    RUNNERS,
    TOOL_CALL_PARSERS,
    FaultToleranceConfig,
    ShoalConfig,
)
from shoal.config.disaggregation import DISAGG_ROLES
from shoal.config.kv_transfer import OFFLOADING_BACKENDS
from shoal.config.lora import LORA_RANKS, parse_lora_module
from shoal.config.speculative import JSON_KEYS, speculative_options
from shoal.deploy.deployment import build_config

GIB = 1 << 30
KV_OFFLOAD_FLAGS = ("kv_transfer_config", "kv_offloading_size", "kv_offloading_backend")
JSON_GROUP_FLAGS = ("speculative_config",)  # a group's JSON, passed whole when given
Group = argparse._ArgumentGroup


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def memory_size(text: str) -> int:
    """Bytes from ``'2GiB'``, ``'512MiB'``, ``'1.5G'`` or a plain number of bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": GIB, "t": 1 << 40}
    cleaned = text.strip().lower().removesuffix("ib").removesuffix("b")
    factor = 1
    if cleaned and cleaned[-1] in units:
        factor, cleaned = units[cleaned[-1]], cleaned[:-1]
    try:
        value = float(cleaned) * factor
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 2GiB, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return int(value)


def option_default(option: str) -> Any:
    """The default of a config option, from its struct."""
    struct = GROUPS[OPTION_GROUPS[option]]
    info = msgspec.inspect.type_info(struct)
    assert isinstance(info, msgspec.inspect.StructType)
    field = next(f for f in info.fields if f.name == option)
    return field.default


def _option(
    group: Group,
    *flags: str,
    dest: str,
    help: str,
    type: Callable[[str], Any] | None = None,
    **extra: Any,
) -> None:
    """A flag for the config option ``dest``, with the option's default."""
    default = option_default(dest)
    if isinstance(default, bool):
        extra.setdefault("action", argparse.BooleanOptionalAction)
    elif type is not None:
        extra["type"] = type
    group.add_argument(*flags, dest=dest, default=default, help=help, **extra)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine, KV cache, parallelism and bus flags."""
    _add_model_arguments(parser.add_argument_group("engine"))
    _add_cuda_graph_arguments(parser.add_argument_group("CUDA graphs"))
    _add_chat_arguments(parser.add_argument_group("tokenizer and chat"))
    _add_cache_arguments(parser.add_argument_group("KV cache"))
    _add_parallel_arguments(parser.add_argument_group("parallelism"))
    _add_bus_arguments(parser.add_argument_group("bus"))
    _add_fault_tolerance_arguments(parser.add_argument_group("fault tolerance"))
    _add_kv_offload_arguments(parser.add_argument_group("KV offload"))
    _add_speculative_arguments(parser.add_argument_group("speculative decoding"))
    _add_disaggregation_arguments(parser.add_argument_group("disaggregated prefill"))
    _add_lora_arguments(parser.add_argument_group("LoRA adapters"))
    _add_pooling_arguments(parser.add_argument_group("embeddings (pooling)"))
    _add_observability_arguments(parser.add_argument_group("observability"))


def _add_lora_arguments(g: Group) -> None:
    _option(g, "--enable-lora", dest="enable_lora", help="serve LoRA adapters of the model")
    _option(
        g,
        "--lora-modules",
        dest="lora_modules",
        type=parse_lora_module,
        nargs="+",
        help="adapters served from the start: name=path, or JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'',
    )
    _option(
        g,
        "--max-loras",
        dest="max_loras",
        type=positive_int,
        help="adapters resident per worker at once (the most distinct adapters in one step)",
    )
    _option(
        g,
        "--max-lora-rank",
        dest="max_lora_rank",
        type=int,
        choices=LORA_RANKS,
        help="the highest adapter rank served (its slots are this wide)",
    )
    _option(
        g,
        "--max-cpu-loras",
        dest="max_cpu_loras",
        type=positive_int,
        help="adapters kept in each worker's host memory (default: --max-loras)",
    )


def _add_disaggregation_arguments(g: Group) -> None:
    _option(
        g,
        "--kv-role",
        dest="disagg_role",
        choices=DISAGG_ROLES,
        help="this engine core's part: prefill (prompts whose decode runs elsewhere), decode "
        "(the rest, pulling the KV of prompts prefilled elsewhere) or both (no handovers)",
    )
    _option(
        g,
        "--num-prefill",
        dest="num_prefill",
        type=int,
        help="local mode: prefill engine cores (with --num-decode; the data parallel size is "
        "their sum)",
    )
    _option(g, "--num-decode", dest="num_decode", type=int, help="local mode: decode engine cores")
    _option(
        g,
        "--max-local-prefill-length",
        dest="max_local_prefill_length",
        type=int,
        help="prefill on a prefill engine core only prompts with more uncached tokens than this",
    )
    _option(
        g,
        "--max-prefill-queue-size",
        dest="max_prefill_queue_size",
        type=int,
        help="...and only while a prefill engine core has at most this many requests waiting",
    )
    _option(
        g,
        "--kv-data-host",
        dest="kv_data_host",
        help="the address a prefill worker serves its KV cache on to other hosts (default: every "
        "interface, advertised as this host's name)",
    )
    _option(
        g,
        "--kv-handover-lease-s",
        dest="kv_handover_lease_s",
        type=positive_float,
        help="how long a prefill engine core holds prompt KV that no decode side pulls",
    )


def _add_cuda_graph_arguments(g: Group) -> None:
    _option(
        g,
        "--enforce-eager",
        dest="enforce_eager",
        help="on CUDA, run every step eagerly: no CUDA graphs for decode steps (the CPU has none)",
    )
    _option(
        g,
        "--cuda-graph-sizes",
        dest="cuda_graph_sizes",
        type=positive_int,
        nargs="+",
        help="decode batch sizes to capture as CUDA graphs (default: 1 2 4 and every multiple "
        "of 8 up to --max-num-seqs, at most 512)",
    )


def _add_model_arguments(g: Group) -> None:
    _option(
        g,
        "--served-model-name",
        dest="served_model_name",
        help="the model name clients use (default: the model's path)",
    )
    _option(
        g,
        "--dtype",
        dest="dtype",
        choices=DTYPES,
        help="weights and activations (auto: bfloat16 on CUDA and on CPUs with AVX512-BF16 or "
        "AMX, else float32; SHOAL_AUTO_DTYPE overrides it for a host)",
    )
    _option(
        g,
        "--quantization",
        "-q",
        dest="quantization",
        choices=QUANTIZATION_METHODS,
        help="weight-only quantization of the linear weights at load (CPU): int8 or int4, in "
        "groups of 32 input values (as GGUF Q8_0 and Q4_1); default: the checkpoint's own (a "
        "GGUF file's Q4_0/Q4_1/Q8_0 weights stay quantized)",
    )
    _option(
        g,
        "--dequantize",
        dest="dequantize",
        help="load a GGUF file's quantized weights as floats in --dtype instead of keeping them "
        "quantized",
    )
    _option(
        g,
        "--max-model-len",
        dest="max_model_len",
        type=positive_int,
        help="context length (default: the model's)",
    )
    _option(
        g,
        "--max-num-seqs",
        dest="max_num_seqs",
        type=positive_int,
        help="most requests running at once per engine core",
    )
    _option(
        g,
        "--max-num-batched-tokens",
        dest="max_num_batched_tokens",
        type=positive_int,
        help="token budget of one step (prefill chunks plus decodes)",
    )
    _option(
        g,
        "--max-waiting-requests",
        dest="max_waiting_requests",
        type=positive_int,
        help="queued requests per engine core before it answers 'overloaded' (503)",
    )
    _option(
        g,
        "--scheduling-policy",
        dest="scheduling_policy",
        choices=POLICIES,
        help="fcfs, or priority (lower value first; preempts the lowest priority)",
    )
    _option(
        g,
        "--async-scheduling",
        dest="async_scheduling",
        help="send step N+1 to the workers while step N runs (two steps in flight)",
    )
    _option(g, "--seed", dest="seed", type=int, help="random seed")
    _option(g, "--device", dest="device", help="cpu, or cuda / cuda:N")  # fmt: skip


def _add_observability_arguments(g: Group) -> None:
    _option(
        g,
        "--otlp-traces-endpoint",
        dest="otlp_traces_endpoint",
        help="send OpenTelemetry traces of every request (gateway, engine client, engine core "
        "queue and steps, workers) to this OTLP collector, e.g. http://localhost:4317 (gRPC; "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf: the full URL, e.g. "
        "http://localhost:4318/v1/traces); needs pip install 'shoal[tracing]'",
    )


def _add_pooling_arguments(g: Group) -> None:
    _option(
        g,
        "--runner",
        dest="runner",
        choices=RUNNERS,
        help="what the model is run for: generate (completions, chat) or pooling (embeddings: "
        "/v1/embeddings)",
    )
    _option(g, "--convert", dest="convert", choices=CONVERTS, help="embed: as --runner pooling")
    _option(
        g,
        "--pooler-config",
        dest="pooler_config",
        type=json_object,
        help='how embeddings are pooled: JSON such as \'{"pooling_type": "MEAN", "normalize": '
        "true}' (default: the model's sentence-transformers config, else LAST, normalized)",
    )


def _add_chat_arguments(g: Group) -> None:
    """How requests become prompts and replies: the tokenizer, the chat template, tool calls,
    the model's default sampling parameters."""
    _option(
        g,
        "--enable-auto-tool-choice",
        dest="enable_auto_tool_choice",
        help='tool_choice "auto": parse the tool calls the model writes (needs --tool-call-parser)',
    )
    _option(
        g,
        "--tool-call-parser",
        dest="tool_call_parser",
        choices=TOOL_CALL_PARSERS,
        help="the format of the model's tool calls: hermes (Qwen, Hermes: <tool_call>), "
        "llama3_json (Llama 3.x JSON), mistral ([TOOL_CALLS])",
    )
    _option(
        g,
        "--reasoning-parser",
        dest="reasoning_parser",
        choices=REASONING_PARSERS,
        help="split a reasoning model's <think>...</think> into reasoning_content: deepseek_r1 "
        "(the prompt opens the thinking) or qwen3 (thinking optional)",
    )
    _option(
        g,
        "--structured-outputs-config",
        dest="structured_outputs_config",
        type=json_object,
        help="structured outputs: JSON such as '{\"enable_in_reasoning\": true}' (a grammar "
        "constrains a reasoning model's thinking too; by default it applies after it) or "
        '\'{"backend": "xgrammar"}\' (the only backend)',
    )
    _option(
        g,
        "--tokenizer",
        dest="tokenizer",
        help="the tokenizer to use instead of the model's: a Hugging Face directory, or a GGUF "
        "file (or a built-in model) whose tokenizer to take",
    )
    _option(
        g,
        "--chat-template",
        dest="chat_template",
        help="the chat template, instead of the tokenizer's: a file, or the template itself "
        "(a value with none of '{', '}' or a newline must be a file)",
    )
    _option(
        g,
        "--trust-request-chat-template",
        dest="trust_request_chat_template",
        help="let a chat request bring its own template (chat_template); refused otherwise",
    )
    _option(
        g,
        "--generation-config",
        dest="generation_config",
        help="default sampling parameters of requests that leave them unset: auto (the model's "
        "generation_config.json), vllm (none), or a directory with a generation_config.json",
    )


def _add_cache_arguments(g: Group) -> None:
    _option(g, "--block-size", dest="block_size", type=positive_int, help="tokens per KV block")
    _option(
        g,
        "--enable-prefix-caching",
        dest="enable_prefix_caching",
        help="reuse KV blocks of identical prompt prefixes",
    )
    size = g.add_mutually_exclusive_group()
    _option(
        size,
        "--kv-cache-memory",
        dest="kv_cache_memory_bytes",
        type=memory_size,
        help="KV cache size per worker, e.g. 2GiB",
    )
    _option(size, "--num-gpu-blocks-override", dest="num_gpu_blocks_override",
            type=positive_int, help="exact number of KV blocks per worker")  # fmt: skip


def _add_parallel_arguments(g: Group) -> None:
    _option(
        g,
        "--data-parallel-size",
        "-dp",
        dest="data_parallel_size",
        type=positive_int,
        help="engine cores, each with its own workers",
    )
    _option(g, "--tensor-parallel-size", "-tp", dest="tensor_parallel_size", type=positive_int,
            help="workers per engine core sharing each layer")  # fmt: skip
    _option(
        g,
        "--cpu-threads-bind",
        dest="cpu_threads_bind",
        help="CPU workers' cores: auto (this host's cores split between the workers sharing "
        "them, one thread pinned per core), nobind, or one core list per worker: 0-3|4-7",
    )
    _option(
        g,
        "--enable-expert-parallel",
        dest="enable_expert_parallel",
        help="spread each MoE layer's experts over the data-parallel ranks' workers",
    )
    _option(
        g,
        "--enable-dbo",
        dest="enable_dbo",
        help="dual-batch overlap: split large steps in two micro-batches so one computes while "
        "the other's expert all-to-all is on the wire (needs expert parallelism)",
    )
    _option(
        g,
        "--dbo-decode-token-threshold",
        dest="dbo_decode_token_threshold",
        type=positive_int,
        help="tokens from which a uniform decode step is split",
    )
    _option(
        g,
        "--dbo-prefill-token-threshold",
        dest="dbo_prefill_token_threshold",
        type=positive_int,
        help="tokens from which any other step is split",
    )

    _option(
        g,
        "--routing-mode",
        dest="routing_mode",
        choices=ROUTING_MODES,
        help="kv: send a request to the engine core holding its longest cached prefix, "
        "weighed against load; load: to the least loaded (default: kv with prefix caching and "
        "--data-parallel-size above 1, else load)",
    )
    _option(
        g,
        "--routing-load-weight",
        dest="routing_load_weight",
        type=float,
        help="kv routing's alpha: score = cached prefix blocks - alpha * requests queued "
        "(how many cached prefix blocks one request of load is worth)",
    )
    _option(
        g,
        "--kv-events-snapshot-interval",
        dest="kv_events_snapshot_interval_s",
        type=float,
        help="kv routing: seconds between an engine core's full snapshots of its prefix cache "
        "(lost events heal within one interval)",
    )


def _add_bus_arguments(g: Group) -> None:
    _option(
        g,
        "--nats-url",
        dest="nats_url",
        action=JoinNatsUrls,
        help="join this NATS deployment (default: start an embedded nats-server); a cluster's "
        "nodes comma-separated and/or the flag repeated (one node is enough to find the "
        "others); no credentials in the URL",
    )
    _option(
        g,
        "--jetstream-replicas",
        dest="jetstream_replicas",
        type=positive_int,
        help="copies of each JetStream bucket and stream on a NATS cluster (3 on 3 nodes "
        "survives losing one)",
    )
    _option(
        g,
        "--bus",
        dest="bus",
        choices=BUS_KINDS,
        help="nats: actors as processes; memory: everything in this process",
    )
    _option(g, "--namespace", dest="namespace",
            help="subject prefix, so deployments can share a NATS cluster")  # fmt: skip


NATS_SCHEMES = ("nats://", "tls://", "ws://", "wss://")


def nats_urls(text: str) -> list[str]:
    """The URLs of one ``--nats-url``: comma-separated, each with a NATS scheme and no user
    info (a password there would show in the process list and in logs)."""
    urls = [url.strip() for url in text.split(",") if url.strip()]
    if not urls:
        raise argparse.ArgumentTypeError(
            f"expected nats://HOST:PORT[,nats://HOST:PORT...], got {text!r}"
        )
    for url in urls:
        if not url.startswith(NATS_SCHEMES):
            shown = redact_url(url) if url_has_secret(url) else url
            raise argparse.ArgumentTypeError(f"expected a nats:// (or tls://) URL, got {shown!r}")
        if url_has_secret(url):
            raise argparse.ArgumentTypeError(
                "credentials in a NATS URL would show on the command line: pass them in "
                "SHOAL_NATS_USER and SHOAL_NATS_PASSWORD instead"
            )
    return urls


class JoinNatsUrls(argparse.Action):
    """``--nats-url`` given once or repeated: every URL of every occurrence, comma-joined (each
    once, in order), as ``BusConfig.nats_url`` holds them."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        try:
            urls = nats_urls(str(values))
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentError(self, str(exc)) from None
        previous = getattr(namespace, self.dest, None) or ""
        joined = [*previous.split(","), *urls] if previous else urls
        setattr(namespace, self.dest, ",".join(dict.fromkeys(joined)))


def add_deployment_bus_arguments(parser: argparse.ArgumentParser, namespace: str) -> None:
    """``--nats-url`` (required) and ``--namespace`` (default ``namespace``): the deployment
    whose bus a tool joins (``shoal probe``, ``shoal status``, ``shoal top``)."""
    parser.add_argument(
        "--nats-url",
        dest="nats_url",
        metavar="URL",
        action=JoinNatsUrls,
        required=True,
        help="the deployment's NATS servers (comma-separated, or the flag repeated)",
    )
    parser.add_argument("--namespace", default=namespace, help="the deployment's subject prefix")


def json_object(text: str) -> dict[str, Any]:
    try:
        value = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _add_fault_tolerance_arguments(g: Group) -> None:
    _option(
        g,
        "--enable-fault-tolerance",
        dest="enable_fault_tolerance",
        help="an engine core that faults waits for recovery (retried by the recovery "
        "controller) instead of failing, and its requests resume on a healthy engine core "
        "(on by default; vLLM's is off)",
    )
    g.add_argument(
        "--fault-tolerance-config",
        dest="fault_tolerance_config",
        type=json_object,
        default=None,
        help="JSON, e.g. '{\"engine_recovery_timeout_sec\": 120}' (turns fault tolerance on); "
        "fields: " + ", ".join(FaultToleranceConfig.__struct_fields__),
    )


def _add_kv_offload_arguments(g: Group) -> None:
    either = g.add_mutually_exclusive_group()
    either.add_argument(
        "--kv-transfer-config",
        dest="kv_transfer_config",
        type=json_object,
        default=None,
        help="KV offload in vLLM's spelling: JSON such as '{\"kv_connector\": "
        '"OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": '
        '{"cpu_bytes_to_use": 8589934592, "eviction_policy": "arc", "secondary_tiers": '
        '[{"type": "fs", "path": "/mnt/kv"}, {"type": "obj", "bytes_to_use": 68719476736}, '
        '{"type": "p2p"}], "canonical_layout": true, "backpressure": {"high_water_s": 2.0}}}\'',
    )
    either.add_argument(
        "--kv-offloading-size",
        dest="kv_offloading_size",
        type=positive_float,
        default=None,
        help="KV offload to a CPU tier of this many GiB (all workers together)",
    )
    g.add_argument(
        "--kv-offloading-backend",
        dest="kv_offloading_backend",
        choices=OFFLOADING_BACKENDS,
        default=OFFLOADING_BACKENDS[0],
        help="the backend of --kv-offloading-size (shoal's own tier actors)",
    )


def speculative_json(text: str) -> dict[str, Any]:
    """``--speculative-config``: a JSON object whose keys and values the group accepts (an
    argparse error naming the key otherwise)."""
    value = json_object(text)
    try:
        speculative_options(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _add_speculative_arguments(g: Group) -> None:
    g.add_argument(
        "--speculative-config",
        dest="speculative_config",
        type=speculative_json,
        default=None,
        help="the configurations for speculative decoding, as JSON in vLLM's spelling, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
        '"prompt_lookup_max": 3}\' or \'{"model": "/path/to/draft", '
        '"num_speculative_tokens": 2}\'; keys: ' + ", ".join(JSON_KEYS),
    )


def config_from_namespace(ns: argparse.Namespace, model: str | None) -> ShoalConfig:
    """The config from parsed flags (every config option among them); ``ValueError`` with a
    readable message if invalid."""
    options = {k: v for k, v in vars(ns).items() if k in OPTION_GROUPS}
    if getattr(ns, "fault_tolerance_config", None) is not None:
        options["fault_tolerance_config"] = ns.fault_tolerance_config
        if ns.enable_fault_tolerance == option_default("enable_fault_tolerance"):
            del options["enable_fault_tolerance"]  # not given: the JSON says (on unless it's off)
    for name in (*KV_OFFLOAD_FLAGS, *JSON_GROUP_FLAGS):  # a group's JSON (and a shortcut)
        if getattr(ns, name, None) is not None:
            options[name] = getattr(ns, name)
    options["model"] = model
    return build_config(**options)
