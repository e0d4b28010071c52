"""Smoke tests of the benchmarks at tiny sizes: ``bench/throughput.py`` (shoal beside
transformers' static batches at each swept size and its continuous batching, one warm-up and the
same rounds each), ``bench/throughput_e2e.py`` (NATS, in-memory bus and transformers, the same
warm-up and rounds, processes per side) and ``bench/serve.py`` (distinct or shared-prefix
prompts, a warm-up, fixed concurrency and Poisson rate levels, failed requests counted) against
the real engine stack, ``bench/offload.py`` (returning turns in five modes, loads beside a
memory copy, LRU vs ARC), ``bench/spec_decode.py`` (every static K and dynamic mode on each
workload, greedy outputs unchanged by speculation), ``bench/routing.py`` (kv and load routing
on a shared-prefix and a unique trace), ``bench/structured.py`` (a batch half under a JSON
schema against a free one, and the mask's cost per step), ``bench/tracing.py`` (a server
traced and one not, the traced one exporting) and ``bench/scheduler.py`` (each case on the C
and the Python block arrays, taking the same steps). Each ends with one JSON line; no
timing is asserted (the machine is shared)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from bench import serve
from bench.spec_decode import WORKLOADS
from shoal.bus.transport.memory import InMemoryBus
from shoal.gateway.app import create_app
from shoal.gateway.server import start_http_server
from tests.integration.engine_stack import engine_stack

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _last_json(done: subprocess.CompletedProcess[str]) -> dict:
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----- bench/throughput.py


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_throughput_sweeps_hf_batches_and_adds_continuous_batching():
    done = _run(
        str(BENCH / "throughput.py"),
        "--quick",
        "--tiny",
        "--num-prompts",
        "4",
        "--hf-batches",
        "2,4,8",
        "--rounds",
        "2",
        timeout=280,
    )
    out = _last_json(done)
    # Sizes above the number of prompts are clipped to it; each swept size has a figure.
    assert out["hf_batches"] == [2, 4] and set(out["hf_batch_tok_s"]) == {"2", "4"}
    best = out["hf_batch_best"]
    assert out["hf_batch_tok_s"][str(best)] == max(out["hf_batch_tok_s"].values())
    assert out["hf_tok_s"] == out["hf_batch_tok_s"][str(best)]
    assert out["hf_cb_tok_s"] > 0 and out["shoal_tok_s"] > 0
    assert out["hf_best_tok_s"] == max(out["hf_tok_s"], out["hf_cb_tok_s"])
    assert out["ratio"] == pytest.approx(out["shoal_tok_s"] / out["hf_best_tok_s"], rel=0.01)
    # The same rounds for shoal, the best static batch and continuous batching, after a warm-up.
    rounds = out["rounds_per_mode"]
    assert rounds["shoal"] == rounds[f"hf_static_{best}"] == rounds["hf_continuous"] == 2
    assert set(out["warmed_up"]) == set(rounds) and out["tokens"] >= 4 * 16


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_throughput_runs_a_gguf_model(tiny_checkpoint, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from tests.fixtures.gguf_files import write_gguf

    gguf_file, _ = write_gguf(tiny_checkpoint("llama"), tmp_path / "tiny.gguf", "Q8_0")
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(tmp_path / "cache"))  # the file's view goes here
    done = _run(
        str(BENCH / "throughput.py"),
        *("--model", str(gguf_file), "--quick", "--num-prompts", "4"),
        *("--hf-batches", "4", "--skip-hf-cb"),
        timeout=110,
    )
    out = _last_json(done)
    # shoal ran the file through its view, transformers the file itself; the report names it.
    assert out["model"] == str(gguf_file) and f"model: {gguf_file}, " in done.stdout
    assert 0 < out["num_params"] < 1_000_000 and out["shoal_tok_s"] > 0 and out["hf_tok_s"] > 0
    assert out["hf_cb_tok_s"] is None and out["tokens"] >= 4 * 16
    assert list((tmp_path / "cache" / "gguf").iterdir())


# ----- bench/throughput_e2e.py


@pytest.mark.timeout(300)
@pytest.mark.nats
@pytest.mark.slow
def test_e2e_gives_transformers_the_same_warmup_and_rounds():
    done = _run(
        str(BENCH / "throughput_e2e.py"),
        "--quick",
        "--tiny",
        "--num-prompts",
        "4",
        "--hf-batch",
        "2",
        "--rounds",
        "2",
        timeout=280,
    )
    figures = _last_json(done)
    for key in ("nats_tok_s", "memory_tok_s", "hf_tok_s", "nats_vs_memory", "nats_vs_hf"):
        assert isinstance(figures[key], int | float) and figures[key] > 0, (key, figures)
    assert figures["nats_bus_step_us"] > 0 and figures["memory_bus_step_us"] > 0
    for key in ("nats_tok_s_rounds", "memory_tok_s_rounds", "hf_tok_s_rounds"):
        assert len(figures[key]) == 2, (key, figures)
    assert figures["hf_tok_s"] == max(figures["hf_tok_s_rounds"])
    assert figures["warmed_up"] == ["nats", "memory", "hf"]
    processes = figures["processes"]
    # the client here, worker, engine core, recovery controller (fault tolerance's default), nats
    assert (processes["nats"], processes["memory"], processes["hf"]) == (5, 1, 1)
    assert processes["torch_threads_per_process"] == figures["threads"] == 1
    # Every requested token came back through both paths, with the whole workload resident.
    assert figures["num_prompts"] == 4 and figures["tokens"] >= 4 * 16
    assert figures["steps"] > 0 and figures["preemptions"] == 0


@pytest.mark.parametrize(
    ("name", "script"),
    [
        ("throughput", "throughput_e2e.py"),
        ("runner-throughput", "throughput.py"),
        ("offload", "offload.py"),
        ("spec_decode", "spec_decode.py"),
    ],
)
def test_cli_bench_aliases(name: str, script: str):
    done = _run("-m", "shoal.deploy.cli", "bench", name, "--help", timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"usage: {script} ")


# ----- bench/serve.py: the workload


def test_serve_prompts_are_distinct_unless_a_shared_prefix_is_asked_for():
    args = serve.parse_args(["--prompt-words", "8"])
    prompts = [serve.make_prompt(i, args) for i in range(200)]
    assert len(set(prompts)) == 200
    assert len({p.split()[0] for p in prompts}) > 10  # no common first word either
    assert prompts == [serve.make_prompt(i, args) for i in range(200)]  # seeded
    shared = serve.parse_args(["--prompt-words", "8", "--shared-prefix-words", "5"])
    prompts = [serve.make_prompt(i, shared).split() for i in range(50)]
    assert len({tuple(p[:5]) for p in prompts}) == 1
    assert len({tuple(p[5:]) for p in prompts}) == 50 and all(len(p) == 13 for p in prompts)


def test_serve_poisson_arrivals_are_seeded_and_keep_the_rate():
    offsets = serve.arrival_offsets(4.0, 2000, seed=0)
    assert offsets == serve.arrival_offsets(4.0, 2000, seed=0)
    assert offsets != serve.arrival_offsets(4.0, 2000, seed=1)
    gaps = [b - a for a, b in zip([0.0, *offsets], offsets, strict=False)]
    assert all(gap > 0 for gap in gaps)
    mean = sum(gaps) / len(gaps)
    assert 0.2 < mean < 0.3  # 1/rate (seeded, so not flaky)
    # Exponential gaps: about 1 - 1/e of them are shorter than the mean (even spacing: none).
    assert 0.58 < sum(gap < mean for gap in gaps) / len(gaps) < 0.68


def test_serve_parse_args_defaults_to_a_concurrency_sweep_only_without_rates():
    assert serve.parse_args([]).concurrency == [1, 8, 32, 64]
    args = serve.parse_args(["--request-rate", "2,8.5"])
    assert args.concurrency == [] and args.request_rate == [2.0, 8.5]


# ----- bench/serve.py against the real engine stack


@contextlib.asynccontextmanager
async def _gateway(model_dir: Path, prompts: list[str]) -> AsyncIterator[str]:
    """The gateway over a tiny real engine; every request's prompt is appended to ``prompts``."""

    @web.middleware
    async def record(request: web.Request, handler):  # type: ignore[no-untyped-def]
        if request.method == "POST":
            prompts.append((await request.json())["prompt"])
        return await handler(request)

    bus = InMemoryBus()
    await bus.connect()
    try:
        async with engine_stack(bus, model_dir) as stack:
            app = create_app(stack.client, served_model_name="tiny")
            app.middlewares.append(record)
            server = await start_http_server(app)
            try:
                yield server.url
            finally:
                await server.stop()
    finally:
        await bus.close()


def _serve_args(url: str) -> list[str]:
    return ["--url", url, "--num-requests", "4", "--max-tokens", "4", "--prompt-words", "6"]


@pytest.mark.timeout(120)
@pytest.mark.slow
async def test_serve_warms_up_then_runs_concurrency_and_rate_levels(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    sent: list[str] = []
    async with _gateway(tiny_checkpoint("llama"), sent) as url:
        args = serve.parse_args(
            [
                *_serve_args(url),
                *("--warmup-requests", "2", "--concurrency", "2"),
                *("--request-rate", "50", "--max-concurrency", "3"),
            ]
        )
        summary = await serve.sweep(args)
    json.dumps(summary)  # the printed line is plain JSON
    by_mode = {level["mode"]: level for level in summary["levels"]}
    assert by_mode["concurrency"]["concurrency"] == 2 and by_mode["rate"]["request_rate"] == 50
    for level in by_mode.values():
        assert level["num_requests"] == 4 and level["num_failed"] == 0, level
        assert level["tok_s"] > 0 and level["ttft_ms_p50"] is not None, level
    assert summary["warmup"] == {"num_requests": 2, "num_failed": 0, "errors": {}}
    assert summary["num_failed"] == 0 and summary["prompts"] == "distinct"
    # Warm-up and both levels reached the server, each request with its own prompt.
    assert len(sent) == 2 + 4 + 4 and len(set(sent)) == len(sent)


@pytest.mark.timeout(120)
@pytest.mark.slow
async def test_serve_counts_and_reports_failed_requests(tiny_checkpoint, capsys) -> None:  # type: ignore[no-untyped-def]
    sent: list[str] = []
    async with _gateway(tiny_checkpoint("llama"), sent) as url:
        # Prompts over the model's 1024-token context: every request is refused.
        args = serve.parse_args(
            [
                *_serve_args(url),
                *("--warmup-requests", "0", "--concurrency", "2"),
                *("--request-rate", "100", "--prompt-words", "1500"),
            ]
        )
        summary = await serve.sweep(args)
    for level in summary["levels"]:
        assert level["num_requests"] == level["num_failed"] == 4, level
        assert level["errors"] == {"HTTP 400": 4} and level["req_s"] == 0, level
    assert summary["num_failed"] == 8 and len(sent) == 8
    assert "4 failed with HTTP 400" in capsys.readouterr().err


async def test_serve_cut_streams_and_error_chunks_are_failed_requests() -> None:
    async def cut(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        if request.query.get("error"):
            await response.write(b'data: {"error": {"message": "engine died"}}\n\n')
            await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", cut)
    server = await start_http_server(app)
    try:
        async with aiohttp.ClientSession() as session:
            url = f"{server.url}/v1/completions"
            results = [await serve.one_request(session, url + q, {}) for q in ("", "?error=1")]
    finally:
        await server.stop()
    assert [(r.ok, r.error) for r in results] == [
        (False, "stream cut: no [DONE]"),
        (False, "error chunk: engine died"),
    ]


async def test_serve_connection_errors_are_failed_requests_not_a_crash() -> None:
    async with aiohttp.ClientSession() as session:
        result = await serve.one_request(session, "http://127.0.0.1:9/v1/completions", {})
    assert not result.ok and result.error.startswith("ClientConnectorError")


# ----- bench/async_sched.py


@pytest.fixture(scope="module")
def built_demo_model() -> None:
    """The demo checkpoint in the cache, built first in a process of its own (about 1.5 min on
    two idle cores, several times that on a busy machine), so the bench's own time limit covers
    the bench only."""
    build = "from shoal.workers.demo import ensure_demo_model; ensure_demo_model()"
    done = _run("-c", build, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.timeout(1200)
@pytest.mark.nats
@pytest.mark.slow
def test_async_sched_runs_both_sides_on_both_models(built_demo_model: None):
    done = _run(
        str(BENCH / "async_sched.py"),
        "--quick",
        "--tiny",
        "--num-prompts",
        "4",
        "--max-tokens",
        "8",
        timeout=280,
    )
    figures = _last_json(done)
    for key in ("async_tok_s", "sync_tok_s", "ratio"):
        assert isinstance(figures[key], int | float) and figures[key] > 0, (key, figures)
    for key in ("worker_idle_pct_async", "worker_idle_pct_sync"):
        assert isinstance(figures[key], int | float) and figures[key] >= 0, (key, figures)
    assert set(figures["models"]) == {"demo", "llama"} and figures["model"] == "demo"
    for model in figures["models"].values():
        assert model["max_steps_in_flight"] == {"async": 2, "sync": 1}, model
        assert model["tokens"] == 4 * 8, model


# ----- bench/recovery.py


@pytest.mark.timeout(300)
@pytest.mark.nats
@pytest.mark.slow
def test_recovery_times_faults_and_loses_no_request():
    done = _run(
        str(BENCH / "recovery.py"),
        "--quick",
        "--faults", "4",
        "--num-requests", "16",
        "--max-tokens", "8",
        "--storm-interval-s", "0.3",
        timeout=280,
    )  # fmt: skip
    figures = _last_json(done)
    assert len(figures["recover_s"]["inject"]) == len(figures["recover_s"]["kill"]) == 2
    for key in ("recover_s_p50", "recover_s_p99", "kill_recover_s_p50", "goodput_ratio"):
        assert isinstance(figures[key], int | float) and figures[key] > 0, (key, figures)
    assert figures["requests_lost"] == 0, figures  # resumption on: every request completes


# ----- bench/offload.py


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_offload_compares_modes_bandwidth_and_policies():
    done = _run(
        str(BENCH / "offload.py"),
        "--quick", "--tiny",
        "--prefix-tokens", "256",
        "--trace-prefix-tokens", "64",
        "--memcpy-mib", "16",
        timeout=110,
    )  # fmt: skip
    figures = _last_json(done)
    tiers = ("cpu", "fs", "obj", "p2p")
    assert set(figures["ttft_ms"]) == {"recompute", *tiers}
    assert all(t > 0 for t in figures["ttft_ms"].values()), figures
    # The returning turns (greedy) come out the same whichever way their prefix came back.
    assert figures["outputs_equal"] is True and figures["trace_outputs_equal"] is True
    # Only the offload modes load: the whole prefix is back, from the CPU tier or (promoted)
    # from the filesystem tier, the object store or the other host's CPU tier; offload off
    # recomputes it.
    assert all(figures["cached_tokens"][tier] == [256, 256] for tier in tiers), figures
    assert figures["hit_tokens"]["recompute"] == 0 < figures["hit_tokens"]["cpu"]
    for tier in ("fs", "obj", "p2p"):
        assert figures["promoted_chunks"][tier] > 0, figures
        assert figures["cascade_dropped_chunks"][tier] == 0, figures
        assert figures["promote_gbps"][tier] > 0, figures
    for key in ("load_gbps", "memcpy_gbps", "load_vs_memcpy", "load_gbps_fs", "p2p_vs_cpu"):
        assert isinstance(figures[key], float) and figures[key] > 0, (key, figures)
    # Scans outgrow the CPU tier between hot returns: LRU loses the hot prefixes, ARC keeps them.
    assert 0 <= figures["hit_rate_lru"] < figures["hit_rate_arc"] <= 1, figures
    for policy in ("lru", "arc"):
        assert figures[f"ttft_hot_ms_{policy}"] > 0
        assert figures["trace_query_tokens"][policy] > 0


# ----- bench/scheduler.py


@pytest.mark.timeout(120)
def test_scheduler_bench_runs_each_case_on_both_block_arrays_alike():
    from shoal.engine.core.block_pool_arrays import native_block_arrays_available

    kinds = ["native", "python"] if native_block_arrays_available() else ["python"]
    done = _run(
        str(BENCH / "scheduler.py"),
        "--cases", "64:on", "--repeats", "1", "--block-arrays", ",".join(kinds),
        timeout=110,
    )  # fmt: skip
    cases = _last_json(done)["cases"]
    assert [case["block_arrays"] for case in cases] == kinds
    # One scheduler, two array implementations: the same steps and the same prefix hits.
    assert len({(case["steps"], case["prefix_cache_hit_rate"]) for case in cases}) == 1, cases
    assert all(case["p99_over_p50"] >= 1 and case["prefix_cache_hit_rate"] > 0 for case in cases)


# ----- bench/spec_decode.py


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_spec_decode_measures_every_k_and_dynamic_mode_and_keeps_greedy_outputs():
    done = _run(str(BENCH / "spec_decode.py"), "--quick", "--tiny", timeout=170)
    out = _last_json(done)  # exit status 0: greedy outputs equal with and without speculation
    assert out["greedy_outputs_equal"] is True and out["mismatches"] == []
    assert "greedy outputs identical with and without speculation: True" in done.stdout
    sizes, ks = out["batch_sizes"], out["ks"]
    assert sizes == [1, 4] and ks == [0, 1, 2, 3, 5]
    static = {(r["workload"], r["batch_size"], r["k"]): r for r in out["rows"]}
    assert set(static) == {(w, b, k) for w in WORKLOADS for b in sizes for k in ks}
    dynamic = {(r["workload"], r["batch_size"], r["mode"]): r for r in out["dynamic"]}
    modes = ("table", "acceptance")
    assert set(dynamic) == {
        (w, b, m) for w in (*WORKLOADS, "changing") for b in sizes for m in modes
    }
    assert all(r["tok_s"] > 0 for r in [*out["rows"], *out["dynamic"]])
    # No drafts without speculation; the repetitive workload's drafts are mostly accepted
    # (several tokens per request and step), though not all (the greedy check covers
    # rejections), the non-repetitive one's seldom.
    assert all(static[(w, b, 0)]["acceptance"] is None for w in WORKLOADS for b in sizes)
    repetitive = [static[("repetitive", b, k)] for b in sizes for k in ks[1:]]
    assert all(
        r["acceptance"] >= 0.6 and r["tokens_per_step"] > r["batch_size"] for r in repetitive
    )
    assert min(r["acceptance"] for r in repetitive) < 1.0
    for b in sizes:
        for k in ks[1:]:
            other = static[("non_repetitive", b, k)]
            assert (other["acceptance"] or 0) < 0.5, other
    # The changing workload reports its two phases: repetitive, then not.
    for b in sizes:
        first, second = dynamic[("changing", b, "table")]["phases"]
        assert first["acceptance"] >= 0.6 > (second["acceptance"] or 0)
    speedups = out["ngram_speedup_bs1_by_k"]
    assert set(speedups) == {"1", "2", "3", "5"}
    assert out["ngram_speedup_bs1"] == max(speedups.values())
    assert set(out["acceptance_vs_table_changing"]) == {"1", "4"}
    assert len(out["dynamic_vs_best_static"]) == len(WORKLOADS) * len(sizes)


# ----- bench/dbo.py


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_dbo_runs_both_kinds_on_and_off_with_a_labelled_injected_link():
    done = _run(
        str(BENCH / "dbo.py"),
        *("--tokens", "16,40", "--kinds", "prefill,decode", "--reps", "1", "--warmup", "0"),
        *("--calibrate-tokens", "16"),
        timeout=240,
    )
    out = _last_json(done)
    assert "INJECTED link:" in done.stdout and out["link"] == "bandwidth"
    assert out["link_mb_s"] > 0  # calibrated from the bytes a step sends
    keys = {"kind", "tokens_per_step", "dbo_off_ms", "dbo_on_ms", "gain_pct", "split_by_default"}
    assert all(keys <= set(r) for r in out["rows"])
    assert [(r["kind"], r["tokens_per_step"]) for r in out["rows"]] == [
        ("prefill", 16), ("prefill", 40), ("decode", 16), ("decode", 40),
    ]  # fmt: skip
    assert [r["split_by_default"] for r in out["rows"]] == [False, False, False, True]
    assert all(r["dbo_off_ms"] > 0 and r["dbo_on_ms"] > 0 for r in out["rows"])
    assert out["best_gain_pct"] == max(r["gain_pct"] for r in out["rows"])
    assert out["link_delay"] == "injected" and out["link_delay_ms"] > 0


# ----- bench/routing.py


@pytest.mark.timeout(300)
@pytest.mark.nats
@pytest.mark.slow
def test_routing_compares_kv_and_load_routing_on_both_traces():
    figures = _last_json(_run(str(BENCH / "routing.py"), "--quick", "--tiny", timeout=280))
    keys = ("hit_rate_kv", "hit_rate_load", "hit_rate_max", "ttft_p50_kv_ms", "ttft_p50_load_ms")
    assert all(isinstance(figures[k], int | float) for k in keys), figures
    assert 0 < figures["hit_rate_max"] <= 1 and figures["hit_rate_kv"] <= figures["hit_rate_max"]
    # kv routing sends returning turns to their cache (load routing reached ~57% of the best)
    assert figures["hit_rate_kv"] >= 0.9 * figures["hit_rate_max"], figures
    assert figures["ttft_p50_kv_ms"] > 0 and figures["unique_ttft_p50_load_ms"] > 0


@pytest.mark.timeout(1200)
@pytest.mark.slow
def test_structured_compares_a_mixed_batch_with_a_free_one(built_demo_model: None):
    figures = _last_json(_run(str(BENCH / "structured.py"), "--quick", timeout=600))
    keys = ("free_tok_s", "mixed_tok_s", "ratio", "mask_us_per_step")
    assert all(isinstance(figures[k], int | float) and figures[k] > 0 for k in keys), figures
    assert figures["mask_us_per_step"] == pytest.approx(
        figures["fill_us_per_step"] + figures["apply_us_per_step"], abs=0.2
    )


# ----- bench/gpu_check.py (its CPU dry run: the script itself, not a GPU)


@pytest.mark.timeout(300)
def test_gpu_check_dry_run_on_the_cpu():
    done = _run(
        str(BENCH / "gpu_check.py"),
        "--device=cpu",
        "--sections=golden,subsystems",
        "--variants=llama",
        "--modes=graphs",
        timeout=280,
    )
    result = _last_json(done)
    fp32 = [row for row in result["golden"] if row["dtype"] == "float32"]
    assert len(fp32) == 1 and fp32[0]["equal"] == fp32[0]["of"] == 8
    bf16 = [row for row in result["golden"] if row["dtype"] == "bfloat16"]
    assert all(len(row["diverge_at_gap"]) == 8 - row["equal"] for row in bf16)
    subsystems = result["subsystems"]
    assert subsystems["equal"] == subsystems["of"] == 16
    assert subsystems["kv_offload_hits"] > 0 and subsystems["spec_accepted_tokens"] > 0


# ----- bench/disagg.py (its figures; a whole run starts two process deployments: by hand)


def test_disagg_figures_count_stalls_and_the_requests_meeting_their_objectives() -> None:
    from bench.disagg import ModeRun, Timed, mode_figures, parse_args

    args = parse_args(["--itl-slo-ms", "100", "--ttft-slo-ms", "1000"])
    smooth = Timed("stream", 0.0, [0.05 + 0.01 * i for i in range(11)])  # 10 ms gaps
    stalled = Timed("stream", 0.0, [0.05, 0.06, 0.5, 0.51])  # one 440 ms gap
    quick, slow = Timed("long", 0.0, [0.8, 0.9]), Timed("long", 1.0, [2.5])
    run = ModeRun([smooth, stalled, quick, slow], seconds=2.0, stats={"kv_pulls": 0})
    figures = mode_figures(run, args)
    assert figures["stalled_gaps"] == 1 and round(figures["itl_max_ms"]) == 440
    assert figures["num_met_slo"] == 2 and figures["goodput"] == 1.0  # smooth and quick
    assert figures["slo_attainment"] == 0.5
    assert figures["ttft_p50_ms"] == 1150.0  # median of 800 and 1500


# ----- bench/lora.py


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_lora_bench_spreads_a_batch_over_adapters_beside_the_base(tiny_checkpoint):  # type: ignore[no-untyped-def]
    model = tiny_checkpoint("llama")
    args = ("--model", str(model), "--rounds", "1", "--num-prompts", "8", "--prompt-len", "12")
    done = _run(str(BENCH / "lora.py"), *args, "--max-tokens", "4", "--dtype", "float32",
                timeout=230)  # fmt: skip
    out = _last_json(done)
    assert set(out["tok_s"]) == {"0", "1", "4", "16"} and all(out["tok_s"].values())
    # the bench divides unrounded rates; the ones it prints are rounded to 0.1 tokens/s
    assert out["ratio_16"] == pytest.approx(out["tok_s"]["16"] / out["tok_s"]["0"], abs=1e-3)
    assert out["load_ms"] > 0 and out["load_ms_object_store"] > 0


@pytest.mark.timeout(120)
@pytest.mark.slow
@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_serve_drives_each_api_with_the_same_workload(tiny_checkpoint, tmp_path, api) -> None:  # type: ignore[no-untyped-def]
    from tests.integration.served_stack import served_stack, with_chat_template

    model_dir = with_chat_template(tiny_checkpoint("llama"), tmp_path / "model")
    async with served_stack(model_dir) as served:
        args = serve.parse_args(
            [*_serve_args(served.url), "--api", api, "--warmup-requests", "1", "--concurrency", "2"]
        )
        summary = await serve.sweep(args)
    (level,) = summary["levels"]
    assert level["num_requests"] == 4 and level["num_failed"] == 0, level
    assert (
        level["tok_s"] > 0 and level["ttft_ms_p50"] is not None and level["itl_ms_p50"] is not None
    )


# ----- bench/tracing.py


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_tracing_serves_off_and_on_and_the_on_side_exports(tiny_checkpoint):  # type: ignore[no-untyped-def]
    args = ("--model", str(tiny_checkpoint("llama")), "--rounds", "1", "--concurrency", "1,2")
    done = _run(str(BENCH / "tracing.py"), *args, "--max-tokens", "4", timeout=280)
    out = _last_json(done)
    tok_s = {(level["side"], level["concurrency"]): level["tok_s"] for level in out["levels"]}
    assert sorted(tok_s) == [("off", 1), ("off", 2), ("on", 1), ("on", 2)]
    assert all(value > 0 for value in tok_s.values())
    assert out["ratio"] == {c: round(tok_s["on", int(c)] / tok_s["off", int(c)], 3) for c in "12"}
    assert out["ratio_min"] == min(out["ratio"].values())
    assert set(out["ratio_mean"]) == {"1", "2"}  # one round: the mean is the best
    assert out["ratio_mean"] == out["ratio"]
    for side in ("off", "on"):
        assert {"main", "engine", "worker"} <= set(out["cpu_s"][side]), out["cpu_s"]
    assert out["spans_received"] > 0 and out["num_failed"] == 0
