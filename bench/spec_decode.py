"""Speculative decoding with n-gram drafts: tokens/s for static K (0 = off) and dynamic K (vLLM's
batch-size table, and shoal's acceptance-driven K with no table, bounded by the table's largest
K only: it needs no tuning) at several batch sizes, through the real
scheduler and model runner (one step at a time, as ``bench/throughput.py``).

Model: ``bench/throughput.py``'s random Llama shape (~19M parameters with this 512-token
vocabulary; ``--tiny``: ~0.1M, for smoke tests) with its attention output projections zeroed, so
each position's logits depend only on its own token: greedy decoding walks a fixed map on the
vocabulary and falls into one of its cycles, while every layer still does its full work.
Workloads (``--batch-sizes``: that many requests at once, each ``--max-tokens`` output tokens,
eos ignored):

- ``repetitive``: greedy; each prompt is the model's own greedy path from a random token, so it
  mostly holds the cycle the output goes round (the output repeats its context, as code edits,
  RAG and summaries do): n-gram drafts are nearly always accepted. With ``--prompt-noise``
  (0.1 with ``--quick``, else 0) a step of the path jumps to a random token with that chance,
  so that some drafts (copied from across a jump) are rejected and the greedy check covers
  rollbacks; it is off by default because one request whose drafts keep failing (the n-gram
  prefers the earliest match, which may sit before a jump) holds a closed batch for all its
  steps: at batch 64 with 0.1, K = 5 took 66 steps instead of 14.
- ``non_repetitive``: random prompts, seeded sampling at ``--temperature`` (1.5): with a small
  vocabulary the last token has often occurred before, so drafts are often proposed, but the
  sampled continuation seldom matches them. (Sampled outputs differ between configurations, as
  speculation draws differently; at temperature 1 some requests fell into a cycle and stayed.)
- ``changing`` (dynamic K only; ``--changing-batch-sizes``, default those up to 16): a
  repetitive batch, then, once it is done, a non-repetitive one in the same scheduler:
  acceptance collapses midway. Each phase's figures are reported too.

Every configuration has its own loaded runner; each gets one untimed warm-up, then ``--rounds``
timed rounds (3; 1 with ``--quick``), the configurations alternating order from round to round
(and pass to pass: a cell whose runs are short, under ``--min-run-s``, gets up to 4 passes in a
round). A cell's time is its fastest run's, each step timed at its fastest over the runs that
took the same steps (the same tokens scheduled in every step: the same work, so what the minimum
strips is the machine's noise, which reached 10% between identical runs here). Greedy outputs
with speculation must equal those without (checked every round, the repetitive requests; exit
status 1 otherwise). Acceptance is the engine core's: accepted drafts over drafted tokens
(``SchedulerStats.spec_decode_*``). Targets (issue 15): at batch 1 on the repetitive workload
the best n-gram K ≥ 1.5× no speculation; dynamic K within 3% of (or above) the best static K
at every batch size; acceptance-driven K ≥ the table on ``changing``. The default table is a
guess made before measuring (K falls with the batch).

    .venv/bin/python bench/spec_decode.py [--quick] [--tiny] [--threads 1] [--rounds N]
        [--batch-sizes 1,4,16,64] [--ks 0,1,2,3,5] [--table '[[1,4,5],[5,16,3],[17,512,2]]']
        [--lookup 1,3] [--prompt-len 64] [--max-tokens 64]
    shoal bench spec_decode [...]

The last line printed is one JSON object: ``rows`` (static K), ``dynamic`` (table and
acceptance-driven K, the changing workload too, with its ``phases``), ``ngram_speedup_bs1``,
``dynamic_vs_best_static``, ``acceptance_vs_table_changing`` and ``greedy_outputs_equal``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shoal.bus.messages.sampling import SamplingParams
from shoal.config.deployment import ShoalConfig
from shoal.engine.core.request import Request
from shoal.engine.core.scheduler import Scheduler
from shoal.workers.model_runner import ModelRunner

VOCAB = 512  # small: sampled outputs often repeat a token of their context (n-gram drafts)
FIRST_TOKEN = 3  # 0..2 are pad, bos, eos
BLOCK = 16
DEFAULT_TABLE = [[1, 4, 5], [5, 16, 3], [17, 512, 2]]
WORKLOADS = ("repetitive", "non_repetitive")
MAX_PASSES = 4  # per cell and round
Batch = list[tuple[list[int], SamplingParams]]


# ----- model and workloads


def build_looping_model(out_dir: Path, tiny: bool) -> tuple[int, list[int]]:
    """A random Llama (``bench/throughput.py``'s shape, a ``VOCAB``-token vocabulary) with every
    ``o_proj`` zeroed, saved in ``out_dir``; returns its size and its greedy map (token → next
    token: with attention out, each position's logits depend on its own token only)."""
    import transformers

    hidden, ffn, layers = (64, 128, 2) if tiny else (512, 1536, 6)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        initializer_range=0.3,  # peaked logits
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.inference_mode():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
        next_token = model(torch.arange(VOCAB)[:, None]).logits[:, -1].argmax(-1)
    model.save_pretrained(str(out_dir))
    return sum(p.numel() for p in model.parameters()), next_token.tolist()


def greedy_path(
    next_token: list[int], start: int, length: int, noise: float, gen: torch.Generator
) -> list[int]:
    """The model's greedy path from ``start``, except that with probability ``noise`` a step
    jumps to a random token instead (drafts copied from across a jump are rejected)."""
    path = [start]
    jumps = (torch.rand(length, generator=gen) < noise).tolist()
    randoms = torch.randint(FIRST_TOKEN, VOCAB, (length,), generator=gen).tolist()
    while len(path) < length:
        path.append(randoms[len(path)] if jumps[len(path)] else next_token[path[-1]])
    return path


def make_batch(
    kind: str, size: int, args: argparse.Namespace, next_token: list[int], max_tokens: int
) -> Batch:
    """``size`` requests of one workload, the same ones every round."""
    seed = 1000 * size + WORKLOADS.index(kind)
    gen = torch.Generator().manual_seed(seed)
    batch: Batch = []
    for i in range(size):
        start = int(torch.randint(FIRST_TOKEN, VOCAB, (1,), generator=gen))
        if kind == "repetitive":
            prompt = greedy_path(next_token, start, args.prompt_len, args.prompt_noise, gen)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        else:
            prompt = torch.randint(FIRST_TOKEN, VOCAB, (args.prompt_len,), generator=gen).tolist()
            params = SamplingParams(
                temperature=args.temperature, seed=seed + i, max_tokens=max_tokens, ignore_eos=True
            )
        batch.append((prompt, params))
    return batch


# ----- configurations and runs


@dataclass(frozen=True)
class Phase:
    """One batch's share of a run: output tokens, wall time, steps, the engine core's drafts,
    the runner's time in the model forward and in sampling (verifying and proposing), and each
    step's tokens scheduled and wall time."""

    tokens: int
    seconds: float
    steps: int
    drafted: int
    accepted: int
    forward_s: float
    sample_s: float
    step_tokens: tuple[int, ...] = ()
    step_seconds: tuple[float, ...] = ()

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


@dataclass(frozen=True)
class Run(Phase):
    """One timed run (its totals), its phases and every request's output tokens."""

    phases: tuple[Phase, ...] = ()
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    @classmethod
    def of(cls, phases: list[Phase], outputs: list[list[int]]) -> Run:
        def total(name: str) -> Any:
            return sum(getattr(phase, name) for phase in phases)

        fields = ("tokens", "seconds", "steps", "drafted", "accepted", "forward_s", "sample_s")
        return cls(*(total(name) for name in fields), phases=tuple(phases), outputs=outputs)

    @property
    def signature(self) -> tuple[tuple[int, ...], ...]:
        """The tokens scheduled in every step: runs alike in it did the same work."""
        return tuple(phase.step_tokens for phase in self.phases)


def fastest_steps(runs: list[Run]) -> Run:
    """The fastest run, its time made of each step's fastest time over the runs that took the
    very same steps (equal work, so the minimum strips what the machine added: on a shared
    virtual machine identical runs vary by 10%); the fastest run alone when none is alike."""
    fastest = max(runs, key=lambda run: run.tok_s)
    alike = [run for run in runs if run.signature == fastest.signature]
    if len(alike) < 2:
        return fastest
    phases = tuple(
        replace(phase, seconds=sum(map(min, zip(*steps, strict=True))))
        for phase, steps in zip(
            fastest.phases,
            zip(*(tuple(p.step_seconds for p in run.phases) for run in alike), strict=True),
            strict=True,
        )
    )
    return replace(fastest, seconds=sum(phase.seconds for phase in phases), phases=phases)


def spec_config(name: str, args: argparse.Namespace) -> dict[str, Any] | None:
    """``k0`` (off), ``kN`` (static K = N), ``table`` (vLLM's batch-size table) or
    ``acceptance`` (shoal's acceptance-driven K, bounded by the table's largest K)."""
    if name == "k0":
        return None
    lookup = {"method": "ngram", "prompt_lookup_min": args.lookup[0],
              "prompt_lookup_max": args.lookup[1]}  # fmt: skip
    if name.startswith("k"):
        return {**lookup, "num_speculative_tokens": int(name[1:])}
    max_k = max(k for _, _, k in args.table)
    if name == "acceptance":  # adapts on its own: bounded by the largest K only, no table
        return {**lookup, "num_speculative_tokens": max_k, "acceptance_driven_k": True}
    table = {"num_speculative_tokens_per_batch_size": args.table}
    return {**lookup, "num_speculative_tokens": max_k, **table}


@dataclass
class Engine:
    """One configuration's loaded runner, its config and what loading it learned."""

    runner: ModelRunner
    config: ShoalConfig
    facts: Any


def open_engine(model_dir: Path, name: str, args: argparse.Namespace) -> Engine:
    """A loaded runner for configuration ``name`` with room for the largest batch."""
    spec = spec_config(name, args)
    per_request = -(-(args.prompt_len + args.max_tokens + 8) // BLOCK)
    config = ShoalConfig.from_options(
        model=str(model_dir),
        dtype="float32",
        device=args.device,
        block_size=BLOCK,
        max_model_len=args.prompt_len + args.max_tokens + 16,
        max_num_seqs=max(args.batch_sizes),
        max_num_batched_tokens=args.batched_tokens,
        num_gpu_blocks_override=max(args.batch_sizes) * per_request + 16,
        **({} if spec is None else {"speculative_config": spec}),
    )
    runner = ModelRunner(config)
    return Engine(runner, config, runner.load())


def run_phases(engine: Engine, phases: list[Batch], tag: str) -> Run:
    """Each batch submitted once the previous one is done, all in one fresh scheduler (its
    dynamic-K state carries over); outputs in submission order."""
    config = engine.config
    scheduler = Scheduler(
        config.scheduler_config,
        config.cache_config,
        num_blocks=engine.facts.num_blocks,
        max_model_len=engine.facts.max_model_len,
        speculative_config=config.speculative_config,
    )
    outputs: dict[str, list[int]] = {}
    done = []
    for p, batch in enumerate(phases):
        ids = [f"{tag}p{p}-{i}" for i in range(len(batch))]
        for i, (request_id, (prompt, params)) in enumerate(zip(ids, batch, strict=True)):
            outputs[request_id] = []
            scheduler.add_request(
                Request(request_id, prompt, params, client_id="bench", arrival_time=float(i))
            )
        done.append(run_to_completion(engine.runner, scheduler, outputs))
    return Run.of(done, list(outputs.values()))


def run_to_completion(
    runner: ModelRunner, scheduler: Scheduler, outputs: dict[str, list[int]]
) -> Phase:
    """Steps until every request is done, one at a time; drafts counted from the scheduler's
    cumulative counters."""
    before = scheduler.make_stats()
    tokens = steps = 0
    forward_s = sample_s = 0.0
    step_tokens: list[int] = []
    step_seconds: list[float] = []
    started = step_start = time.perf_counter()
    while scheduler.has_requests():
        sched_out = scheduler.schedule()
        result = runner.execute(sched_out.to_message())
        forward_s += runner.timings.forward_s
        sample_s += runner.timings.sample_s
        for outs in scheduler.update_from_output(sched_out, result).values():
            for out in outs:
                outputs[out.request_id] += out.new_token_ids
                tokens += len(out.new_token_ids)
        steps += 1
        step_end = time.perf_counter()
        step_tokens.append(sched_out.total_num_scheduled_tokens)
        step_seconds.append(step_end - step_start)
        step_start = step_end
    seconds = time.perf_counter() - started
    after = scheduler.make_stats()
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    return Phase(
        tokens, seconds, steps, drafted, accepted, forward_s, sample_s,
        tuple(step_tokens), tuple(step_seconds),
    )  # fmt: skip


# ----- rounds


class Bench:
    """Every configuration's engine, its timed runs by (workload, batch size, configuration),
    and the greedy outputs of K = 0 that the others must reproduce."""

    def __init__(self, model_dir: Path, next_token: list[int], args: argparse.Namespace) -> None:
        self.args, self.next_token = args, next_token
        self.static = [f"k{k}" for k in args.ks]
        self.names = [*self.static, "table", "acceptance"]
        self.engines = {name: open_engine(model_dir, name, args) for name in self.names}
        self.runs: dict[tuple[str, int, str], list[Run]] = {}
        self.greedy: dict[int, list[list[int]]] = {}  # batch size → K = 0's repetitive outputs
        self.mismatches: list[str] = []

    def cells(self) -> list[tuple[str, int, list[str]]]:
        """(workload, batch size, configurations) in run order."""
        cells = [(w, bs, self.names) for w in WORKLOADS for bs in self.args.batch_sizes]
        return cells + [("changing", bs, ["table", "acceptance"]) for bs in self.args.changing]

    def phases(self, workload: str, size: int, max_tokens: int) -> list[Batch]:
        kinds = WORKLOADS if workload == "changing" else (workload,)
        return [make_batch(k, size, self.args, self.next_token, max_tokens) for k in kinds]

    def warm_up(self) -> None:
        """One small untimed run of both workloads on every engine (drafting and verifying)."""
        size = min(4, max(self.args.batch_sizes))
        for name in self.names:
            run_phases(self.engines[name], self.phases("changing", size, 8), "warmup-")

    def run_round(self, index: int) -> None:
        """Every cell, its configurations in turn (reversed on odd passes); a cell whose runs
        are short gets more passes (``--min-run-s``, at most ``MAX_PASSES``), as noise."""
        for workload, size, names in self.cells():
            phases = self.phases(workload, size, self.args.max_tokens)
            spent = 0.0
            for p in range(MAX_PASSES):
                for name in names if (index + p) % 2 == 0 else names[::-1]:
                    run = run_phases(self.engines[name], phases, f"r{index}.{p}-")
                    self.check_greedy(workload, size, name, run)
                    self.runs.setdefault((workload, size, name), []).append(run)
                    print_run(workload, size, name, run)
                    spent += run.seconds / len(names)
                if spent >= self.args.min_run_s:
                    break

    def check_greedy(self, workload: str, size: int, name: str, run: Run) -> None:
        """Greedy requests (the repetitive ones) must come out as with speculation off."""
        if workload == "non_repetitive":
            return
        outputs = run.outputs[:size]
        if name == "k0" and workload == "repetitive":
            self.greedy.setdefault(size, outputs)
        reference = self.greedy.get(size)
        if reference is not None and outputs != reference:
            self.mismatches.append(f"{workload} bs={size} {name}")

    def best(self, workload: str, size: int, name: str) -> Run:
        return fastest_steps(self.runs[(workload, size, name)])


def print_run(workload: str, size: int, name: str, run: Run) -> None:
    accepted = "-" if run.acceptance is None else f"{100 * run.acceptance:5.1f}%"
    per_step = {key: 1e3 * value / max(run.steps, 1)
                for key, value in (("all", run.seconds), ("forward", run.forward_s),
                                   ("sample", run.sample_s))}  # fmt: skip
    print(
        f"  {workload:<14} bs={size:<3} {name:<10} {run.tokens:5d} tokens in {run.seconds:6.2f} s "
        f"= {run.tok_s:7.1f} tok/s; {run.steps:3d} steps of {per_step['all']:6.1f} ms (forward "
        f"{per_step['forward']:6.1f}, sample+verify+propose {per_step['sample']:5.1f}); drafted "
        f"{run.drafted:5d}, accepted {accepted}",
        flush=True,
    )


# ----- report


def row(run: Phase) -> dict[str, Any]:
    acceptance = None if run.acceptance is None else round(run.acceptance, 3)
    figures = {
        "tok_s": round(run.tok_s, 1),
        "acceptance": acceptance,
        "drafted_per_token": round(run.drafted / max(run.tokens, 1), 3),
        "tokens_per_step": round(run.tokens / max(run.steps, 1), 2),
        "ms_per_step": round(1e3 * run.seconds / max(run.steps, 1), 2),
        "forward_ms_per_step": round(1e3 * run.forward_s / max(run.steps, 1), 2),
        "sample_ms_per_step": round(1e3 * run.sample_s / max(run.steps, 1), 2),
    }
    if isinstance(run, Run) and len(run.phases) > 1:
        figures["phases"] = [row(phase) for phase in run.phases]
    return figures


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else 0.0


def figures(bench: Bench, num_params: int) -> dict[str, Any]:
    """The JSON line (best round of every cell)."""
    args, sizes = bench.args, bench.args.batch_sizes
    rows, dynamic, versus = [], [], []
    for workload in WORKLOADS:
        for size in sizes:
            tok_s = {name: bench.best(workload, size, name).tok_s for name in bench.names}
            for name in bench.static:
                run = bench.best(workload, size, name)
                rows.append(
                    {"workload": workload, "batch_size": size, "k": int(name[1:]), **row(run)}
                )
            best = max(bench.static, key=lambda name: tok_s[name])
            for mode in ("table", "acceptance"):
                run = bench.best(workload, size, mode)
                dynamic.append({"workload": workload, "batch_size": size, "mode": mode, **row(run)})
            versus.append({
                "workload": workload, "batch_size": size, "best_static_k": int(best[1:]),
                "table": ratio(tok_s["table"], tok_s[best]),
                "acceptance": ratio(tok_s["acceptance"], tok_s[best]),
            })  # fmt: skip
    changing = {}
    for size in args.changing:
        runs = {mode: bench.best("changing", size, mode) for mode in ("table", "acceptance")}
        for mode, run in runs.items():
            dynamic.append({"workload": "changing", "batch_size": size, "mode": mode, **row(run)})
        changing[str(size)] = ratio(runs["acceptance"].tok_s, runs["table"].tok_s)
    return {
        "rows": rows,
        "dynamic": dynamic,
        **speedup_bs1(bench),
        "dynamic_vs_best_static": versus,
        "acceptance_vs_table_changing": changing,
        "greedy_outputs_equal": not bench.mismatches,
        "mismatches": bench.mismatches,
        "table": args.table,
        "prompt_lookup": args.lookup,
        "num_params": num_params,
        "prompt_len": args.prompt_len,
        "temperature": args.temperature,
        "prompt_noise": args.prompt_noise,
        "max_tokens": args.max_tokens,
        "batch_sizes": sizes,
        "changing_batch_sizes": args.changing,
        "ks": args.ks,
        "rounds": args.rounds,
        "min_run_s": args.min_run_s,
        "runs_per_cell": {
            f"{w}/{b}": len(bench.runs[(w, b, names[0])]) for w, b, names in bench.cells()
        },
        "threads": args.threads,
        "device": args.device,
    }


def speedup_bs1(bench: Bench) -> dict[str, Any]:
    """The best n-gram K over K = 0 on the repetitive workload at the smallest batch size."""
    size = min(bench.args.batch_sizes)
    off = bench.best("repetitive", size, "k0").tok_s if "k0" in bench.static else 0.0
    by_k = {name[1:]: ratio(bench.best("repetitive", size, name).tok_s, off)
            for name in bench.static if name != "k0"}  # fmt: skip
    best = max(by_k, key=lambda k: by_k[k]) if by_k and off else None
    return {
        "ngram_speedup_bs1": by_k[best] if best is not None else None,
        "ngram_speedup_bs1_k": int(best) if best is not None else None,
        "ngram_speedup_bs1_by_k": by_k,
        "speedup_batch_size": size,
    }


def report(bench: Bench, out: dict[str, Any]) -> None:
    """Tokens/s side by side (acceptance beside each), the ratios and the targets, then JSON."""
    print(f"model: {out['num_params'] / 1e6:.1f}M-param random Llama (attention output zeroed), "
          f"fp32 on {out['device']}, {out['threads']} thread(s); prompts of {out['prompt_len']} "
          f"tokens, {out['max_tokens']} output tokens each; n-gram lookup {out['prompt_lookup']}, "
          f"table {out['table']}; {out['rounds']} round(s), steps at their fastest in alike runs "
          f"(runs per cell: {out['runs_per_cell']})")  # fmt: skip
    versus = {(v["workload"], v["batch_size"]): v for v in out["dynamic_vs_best_static"]}
    for workload in WORKLOADS:
        print(f"{workload}: tok/s (draft acceptance)")
        print("  bs   " + "".join(f"{name:>17}" for name in bench.names))
        for size in bench.args.batch_sizes:
            cells = "".join(f"{cell(bench.best(workload, size, n)):>17}" for n in bench.names)
            v = versus[(workload, size)]
            print(f"  {size:<4} {cells}   best static k={v['best_static_k']}; table/best "
                  f"{v['table']:.3f}, acceptance/best {v['acceptance']:.3f}")  # fmt: skip
    print("changing (repetitive batch, then non-repetitive): tok/s (acceptance) overall; phase 1; "
          "phase 2 with its drafts per output token")  # fmt: skip
    for size in bench.args.changing:
        for mode in ("table", "acceptance"):
            run = bench.best("changing", size, mode)
            phases = "; ".join(f"{cell(phase)} {phase.drafted / phase.tokens:.2f}/tok"
                               for phase in run.phases)  # fmt: skip
            print(f"  bs={size:<4} {mode:<10} {cell(run)}; {phases}")
        print(
            f"  bs={size:<4} acceptance/table {out['acceptance_vs_table_changing'][str(size)]:.3f}"
        )
    print_targets(out)
    print(json.dumps(out))


def cell(run: Phase) -> str:
    acceptance = "  -  " if run.acceptance is None else f"{100 * run.acceptance:4.0f}%"
    return f"{run.tok_s:8.1f} ({acceptance})"


def print_targets(out: dict[str, Any]) -> None:
    speedup = out["ngram_speedup_bs1"]
    print(f"target n-gram >= 1.5x no speculation at bs={out['speedup_batch_size']} "
          f"(repetitive): {speedup}x (k={out['ngram_speedup_bs1_k']}; by k "
          f"{out['ngram_speedup_bs1_by_k']})")  # fmt: skip
    for mode in ("table", "acceptance"):
        worst = min(out["dynamic_vs_best_static"], key=lambda v: v[mode])
        print(f"target {mode} K within 3% of the best static K everywhere: worst "
              f"{worst[mode]:.3f} ({worst['workload']}, bs={worst['batch_size']})")  # fmt: skip
    changing = out["acceptance_vs_table_changing"]
    print(f"target acceptance-driven >= table on changing: {changing}")
    print(f"greedy outputs identical with and without speculation: {out['greedy_outputs_equal']}"
          + (f" (differ: {out['mismatches']})" if out["mismatches"] else ""))  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-sizes", type=ints, default=None, help="default 1,4,16,64")
    parser.add_argument("--ks", type=ints, default=[0, 1, 2, 3, 5], help="static K (0: off)")
    parser.add_argument("--table", type=json.loads, default=DEFAULT_TABLE,
                        help="num_speculative_tokens_per_batch_size (JSON)")  # fmt: skip
    parser.add_argument("--lookup", type=ints, default=[1, 3], help="prompt_lookup_min,max")
    parser.add_argument(
        "--changing-batch-sizes", dest="changing", type=ints, default=None, help="default 1,4,16"
    )
    parser.add_argument("--prompt-len", type=int, default=None, help="default 64")
    parser.add_argument(
        "--prompt-noise",
        type=float,
        default=None,
        help="chance that a step of a repetitive prompt jumps to a random token (default 0; "
        "0.1 with --quick)",
    )
    parser.add_argument(
        "--temperature", type=float, default=1.5, help="of the non-repetitive workload's sampling"
    )
    parser.add_argument("--max-tokens", type=int, default=None, help="default 64")
    parser.add_argument("--batched-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 3)")
    parser.add_argument(
        "--min-run-s",
        type=float,
        default=None,
        help="a cell's configurations get passes in a round until each had about this long "
        f"(at most {MAX_PASSES}; default 1, 0 with --quick)",
    )
    parser.add_argument("--quick", action="store_true", help="bs 1,4; short prompts; 1 round")
    parser.add_argument("--tiny", action="store_true", help="the ~0.6M Llama (smoke tests)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    quick = args.quick
    args.batch_sizes = args.batch_sizes or ([1, 4] if quick else [1, 4, 16, 64])
    args.changing = args.changing or [b for b in args.batch_sizes if b <= 16]
    args.prompt_len = args.prompt_len or (48 if quick else 64)
    args.max_tokens = args.max_tokens or (24 if quick else 64)
    args.rounds = max(1, args.rounds or (1 if quick else 3))
    if args.prompt_noise is None:
        args.prompt_noise = 0.1 if quick else 0.0
    if args.min_run_s is None:
        args.min_run_s = 0.0 if quick else 1.0
    if 0 not in args.ks:
        parser.error("--ks must include 0 (no speculation: the reference)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="shoal-bench-spec-") as tmp:
        num_params, next_token = build_looping_model(Path(tmp), args.tiny)
        bench = Bench(Path(tmp), next_token, args)
        bench.warm_up()
        for index in range(args.rounds):
            print(f"round {index}:", flush=True)
            bench.run_round(index)
    out = figures(bench, num_params)
    report(bench, out)
    return 0 if out["greedy_outputs_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
