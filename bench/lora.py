"""Multi-LoRA throughput: one batch of requests spread over 1, 4 and 16 adapters against the
same batch on the base model alone, in one engine (``LLM`` with ``--enable-lora``), and the time
to bring a new adapter into use.

The model is the default one (``--model``: any name, folder or GGUF file ``shoal serve``
takes). Adapters are written here in PEFT's format with random A and B of ``--rank`` on every
projection (q/k/v/o, gate/up/down), shaped from the model's config.json, so the bench needs
neither PEFT nor a download. ``--num-prompts`` random prompts of ``--prompt-len`` tokens, greedy,
``--max-tokens`` each, eos ignored; request ``i`` of the k-adapter run uses adapter ``i % k``.
The prefix cache is off (the runs share their prompts, under different adapters' keys: a run
would otherwise find its prompts cached by the same run of the round before). Every
configuration is run once untimed (adapters read and resident), then ``--rounds`` timed
rounds in alternating order; each keeps its best. ``load_ms``: the extra latency of a one-token
request whose adapter no worker has read yet, over the same request once it is resident, from a
folder; ``load_ms_object_store``: the same for an adapter pushed to the deployment's object store
(``nats-object://NAME``: the worker fetches it over the bus first; here the in-process bus).

    .venv/bin/python bench/lora.py [--model default] [--rank 16] [--counts 1,4,16]
        [--num-prompts 64] [--prompt-len 128] [--max-tokens 64] [--rounds 2] [--dtype auto]

The last line printed is one JSON object: ``tok_s`` per adapter count (``0``: the base model),
``ratio_16`` (16 adapters over the base), ``load_ms``, ``load_ms_object_store``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shoal import LLM, LoRARequest, SamplingParams
from shoal.bus.folder_objects import put_folder
from shoal.bus.messages.lora import OBJECT_STORE_SCHEME
from shoal.bus.subjects import Subjects
from shoal.deploy.model_source import resolve_model
from shoal.engine.client.model_info import read_text_config

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) of each targetable projection, from a Hugging Face config."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv = int(config.get("num_key_value_heads") or heads) * head_dim
    inter = int(config["intermediate_size"])
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def write_adapter(folder: Path, config: dict[str, Any], rank: int, seed: int) -> Path:
    """A random LoRA adapter of every projection, in PEFT's files."""
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(config["num_hidden_layers"])):
        for name, (n_in, n_out) in projection_shapes(config).items():
            part = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) / n_in**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.01
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    peft_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": list(TARGETS), "bias": "none"}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(peft_config))
    return folder


def timed_run(llm: LLM, prompts: list[list[int]], params: SamplingParams, loras: list) -> float:
    """Generated tokens per second of one pass over every prompt."""
    start = time.perf_counter()
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, lora_request=loras, use_tqdm=False
    )
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def load_latency_ms(llm: LLM, prompt: list[int], fresh: LoRARequest) -> float:
    """A one-token request's latency with an adapter never read, minus with it resident."""
    params = SamplingParams(temperature=0, max_tokens=1)

    def once() -> float:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, lora_request=fresh, use_tqdm=False)
        return time.perf_counter() - start

    cold = once()
    warm = min(once() for _ in range(3))
    return (cold - warm) * 1000


def push_to_object_store(llm: LLM, name: str, folder: Path) -> LoRARequest:
    """The adapter put into the LLM's own bus's object store (reached through its internals:
    an in-process deployment has no other bus to push from)."""
    client = llm._require_client()
    store_bucket = Subjects(llm.config.bus_config.namespace).lora_bucket()

    async def push() -> None:
        store = await client.bus.open_object_store(store_bucket)
        await put_folder(store, name, folder)

    llm._run(push())
    return LoRARequest(name, 10_000, f"{OBJECT_STORE_SCHEME}{name}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--counts", default="1,4,16", help="adapter counts to spread over")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    source = resolve_model(None if args.model == "default" else args.model)
    config = read_text_config(Path(source.directory))
    rng = random.Random(args.seed)
    vocab = int(config["vocab_size"])
    prompts = [
        [rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    most = max(counts)
    with tempfile.TemporaryDirectory() as tmp:
        folders = [
            write_adapter(Path(tmp) / f"a{i}", config, args.rank, i) for i in range(most + 2)
        ]
        adapters = [LoRARequest(f"a{i}", i + 1, str(f)) for i, f in enumerate(folders)]
        llm = LLM(
            source.directory, dtype=args.dtype, enable_lora=True, max_loras=most,
            max_lora_rank=args.rank, max_cpu_loras=most + 2, max_num_seqs=args.num_prompts,
            enable_prefix_caching=False,  # every run computes every prompt
        )  # fmt: skip
        try:
            runs: dict[int, list] = {0: [None] * len(prompts)}
            for k in counts:
                runs[k] = [adapters[i % k] for i in range(len(prompts))]
            for loras in runs.values():  # untimed: adapters read and resident
                timed_run(llm, prompts[:8], params, loras[:8])
            best = dict.fromkeys(runs, 0.0)
            for round_index in range(args.rounds):
                order = list(runs) if round_index % 2 == 0 else list(reversed(runs))
                for k in order:
                    tok_s = timed_run(llm, prompts, params, runs[k])
                    best[k] = max(best[k], tok_s)
                    print(f"round {round_index}: {k:2d} adapters {tok_s:7.1f} tok/s", flush=True)
            load_ms = load_latency_ms(llm, prompts[0][:32], adapters[most])
            pushed = push_to_object_store(llm, "pushed", folders[most + 1])
            load_ms_store = load_latency_ms(llm, prompts[0][:32], pushed)
        finally:
            llm.shutdown()
    base = best[0]
    print(f"{'adapters':>8}  {'tok/s':>8}  {'x base':>7}")
    for k, tok_s in best.items():
        print(f"{k:8d}  {tok_s:8.1f}  {tok_s / base:7.3f}")
    print(f"new adapter load: {load_ms:.1f} ms from a folder, {load_ms_store:.1f} from the store")
    result = {
        "model": source.served_name or args.model,
        "rank": args.rank,
        "tok_s": {str(k): round(v, 1) for k, v in best.items()},
        "ratio_16": round(best.get(16, 0.0) / base, 3) if 16 in best else None,
        "load_ms": round(load_ms, 1),
        "load_ms_object_store": round(load_ms_store, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
