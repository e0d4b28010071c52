"""The ``shoal`` command line's engine flags, in vLLM's spelling where they mean the same, and
their translation into ``EngineArgs``."""

from __future__ import annotations

import argparse
from pathlib import Path

from shoal.deploy.args import EngineArgs

GIB = 1 << 30


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
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


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine, KV cache, parallelism and bus flags."""
    _add_model_arguments(parser.add_argument_group("engine"))
    _add_cache_arguments(parser.add_argument_group("KV cache"))
    _add_parallel_arguments(parser.add_argument_group("parallelism"))
    _add_bus_arguments(parser.add_argument_group("bus"))


Group = argparse._ArgumentGroup


def _add_model_arguments(g: Group) -> None:
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="weights and activations (auto: float32 on CPU, bfloat16 on CUDA)",
    )
    g.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="context length (default: the model's)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=128,
        help="most requests running at once per engine core",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=2048,
        help="token budget of one step (prefill chunks plus decodes)",
    )
    g.add_argument(
        "--max-waiting-requests",
        type=positive_int,
        default=1024,
        help="queued requests per engine core before it answers 'overloaded' (503)",
    )
    g.add_argument("--seed", type=int, default=0, help="random seed")
    g.add_argument("--device", default="cpu", help="cpu, or cuda / cuda:N")  # fmt: skip


def _add_cache_arguments(g: Group) -> None:
    g.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse KV blocks of identical prompt prefixes",
    )
    size = g.add_mutually_exclusive_group()
    size.add_argument(
        "--kv-cache-memory",
        type=memory_size,
        default=None,
        help="KV cache size per worker, e.g. 2GiB",
    )
    size.add_argument("--num-gpu-blocks-override", type=positive_int, default=None,
                      help="exact number of KV blocks per worker")  # fmt: skip


def _add_parallel_arguments(g: Group) -> None:
    g.add_argument(
        "--data-parallel-size",
        "-dp",
        type=positive_int,
        default=1,
        help="engine cores, each with its own workers",
    )
    g.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                   help="workers per engine core sharing each layer")  # fmt: skip


def _add_bus_arguments(g: Group) -> None:
    g.add_argument(
        "--nats-url",
        default=None,
        help="join this NATS deployment (default: start an embedded nats-server)",
    )
    g.add_argument(
        "--bus",
        default="nats",
        choices=["nats", "memory"],
        help="nats: actors as processes; memory: everything in this process",
    )
    g.add_argument("--namespace", default="shoal",
                   help="subject prefix, so deployments can share a NATS cluster")  # fmt: skip


def engine_args_from(ns: argparse.Namespace, model: str) -> EngineArgs:
    """``EngineArgs`` from parsed flags; ``ValueError`` with a readable message if invalid."""
    if not Path(model).is_dir():
        raise ValueError(f"model directory not found: {model}")
    return EngineArgs(
        model=model,
        served_model_name=getattr(ns, "served_model_name", None),
        dtype=ns.dtype,
        max_model_len=ns.max_model_len,
        block_size=ns.block_size,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        enable_prefix_caching=ns.enable_prefix_caching,
        kv_cache_memory=ns.kv_cache_memory,
        num_gpu_blocks_override=ns.num_gpu_blocks_override,
        data_parallel_size=ns.data_parallel_size,
        tensor_parallel_size=ns.tensor_parallel_size,
        seed=ns.seed,
        max_waiting_requests=ns.max_waiting_requests,
        nats_url=ns.nats_url,
        bus=ns.bus,
        namespace=ns.namespace,
        device=ns.device,
    )
