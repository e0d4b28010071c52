"""Tracing's cost on ``bench/serve.py``: ``shoal serve`` (the default model unless ``--model``)
started afresh per side and round, tracing off and on (``--otlp-traces-endpoint`` to an
in-process OTLP/HTTP collector: every request traced, from the gateway to the worker), and the
same ``bench/serve.py`` sweep against each (``--concurrency`` levels, ``--max-tokens`` each).
Sides alternate over ``--rounds`` and each keeps its best round per level (the machines are
noisy: the rounds' mean throughput is given too). Prints each level side by side; the last line
is one JSON object: ``{"levels": [{"side": "off"|"on", "concurrency", "tok_s", "itl_ms_p50",
"ttft_ms_p50", "e2e_ms_p50"}], "ratio": {concurrency: on over off, best rounds},
"ratio_mean": {concurrency: on over off, mean of the rounds}, "ratio_min", "cpu_s": {side:
{process: CPU seconds of one round's sweep, mean of the rounds}}, "spans_received",
"num_failed"}``. The CPU seconds (from ``/proc``, per process of the server: the gateway's
``main``, ``engine``, ``worker``, ``other``) are the steadier measure of what tracing costs: the
same workload runs on both sides, and the worker's are mostly its threads spinning.

    .venv/bin/python bench/tracing.py [--model NAME|DIR] [--rounds 2] [--concurrency 1,8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.fault_default import stop
from bench.serve import parse_args as serve_args
from bench.serve import sweep, wait_healthy
from shoal.deploy.local import free_tcp_port
from tests.fixtures.otlp_receiver import HttpReceiver

EXPORT = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
ACTOR_CLASSES = {"EngineCoreActor": "engine", "WorkerActor": "worker"}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_processes(pid: int) -> dict[int, str]:
    """The server's processes: its own (``main``: the gateway) and its children by role."""
    processes = {pid: "main"}
    for child in Path("/proc").glob("[0-9]*"):
        try:
            if int((child / "stat").read_text().rsplit(")", 1)[1].split()[1]) != pid:
                continue
            command = (child / "cmdline").read_text()
        except (OSError, ValueError):
            continue
        role = next((r for name, r in ACTOR_CLASSES.items() if name in command), "other")
        processes[int(child.name)] = role
    return processes


def cpu_by_role(processes: dict[int, str]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for pid, role in processes.items():
        try:
            totals[role] = totals.get(role, 0.0) + cpu_seconds(pid)
        except OSError:
            continue
    return totals


def serve_round(args: argparse.Namespace, endpoint: str | None) -> dict[str, Any]:
    """One fresh server (traced to ``endpoint`` when given) and the sweep's summary, with the
    CPU seconds its processes spent on the sweep (``cpu_s``, by role)."""
    port = free_tcp_port()
    shoal = Path(sys.executable).parent / "shoal"
    model = [args.model] if args.model else []
    command = [str(shoal), "serve", *model, "--port", str(port), *shlex.split(args.extra)]
    env = dict(os.environ)
    if endpoint is not None:
        command += ["--otlp-traces-endpoint", endpoint]
        env.update(EXPORT)
    server = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL, env=env)
    levels = ",".join(map(str, args.concurrency))
    load = serve_args(
        ["--url", f"http://127.0.0.1:{port}", "--concurrency", levels,
         "--max-tokens", str(args.max_tokens), "--warmup-requests", "8"]
    )  # fmt: skip
    try:
        asyncio.run(wait_healthy(load.url, load.startup_timeout, server))
        processes = server_processes(server.pid)
        before = cpu_by_role(processes)
        summary = asyncio.run(sweep(load, server))
        after = cpu_by_role(processes)
        summary["cpu_s"] = {role: after[role] - before.get(role, 0.0) for role in after}
        return summary
    finally:
        stop(server)


def mean_tok_s(rounds: list[dict[str, Any]], concurrency: int) -> float:
    """The rounds' mean output tokens/s at ``concurrency``."""
    values = [lv["tok_s"] for s in rounds for lv in s["levels"] if lv["concurrency"] == concurrency]
    return sum(values) / len(values)


def mean_cpu(rounds: list[dict[str, Any]]) -> dict[str, float]:
    """The rounds' mean CPU seconds per process role."""
    roles = {role for summary in rounds for role in summary["cpu_s"]}
    return {
        role: round(sum(s["cpu_s"].get(role, 0.0) for s in rounds) / len(rounds), 2)
        for role in sorted(roles)
    }


def best_levels(rounds: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per concurrency, the round's level with the most output tokens/s."""
    best: dict[int, dict[str, Any]] = {}
    for summary in rounds:
        for level in summary["levels"]:
            held = best.get(level["concurrency"])
            if held is None or level["tok_s"] > held["tok_s"]:
                best[level["concurrency"]] = level
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", default="1,8", help="comma-separated levels")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--extra", default="", help="more `shoal serve` flags for both sides")
    args = parser.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    receiver = HttpReceiver(keep_spans=False)  # counts only: the server's CPU is shared
    rounds: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    try:
        for index in range(args.rounds):
            for traced in (False, True) if index % 2 == 0 else (True, False):
                print(f"round {index}, tracing {'on' if traced else 'off'}:", flush=True)
                rounds[traced].append(serve_round(args, receiver.endpoint if traced else None))
    finally:
        receiver.close()
    best = {"off": best_levels(rounds[False]), "on": best_levels(rounds[True])}
    levels, ratio, ratio_mean = [], {}, {}
    for concurrency in args.concurrency:
        off, on = best["off"][concurrency], best["on"][concurrency]
        ratio[str(concurrency)] = round(on["tok_s"] / off["tok_s"], 3)
        means = mean_tok_s(rounds[True], concurrency), mean_tok_s(rounds[False], concurrency)
        ratio_mean[str(concurrency)] = round(means[0] / means[1], 3)
        for side, level in best.items():
            figures = ("tok_s", "itl_ms_p50", "ttft_ms_p50", "e2e_ms_p50")
            levels.append({"side": side, "concurrency": concurrency} | {
                figure: level[concurrency][figure] for figure in figures
            })  # fmt: skip
        print(
            f"c={concurrency}: off {off['tok_s']:.1f} tok/s, on {on['tok_s']:.1f} tok/s "
            f"(x{ratio[str(concurrency)]:.3f}; round means x{ratio_mean[str(concurrency)]:.3f}); "
            f"ITL p50 {off['itl_ms_p50']:.1f} vs {on['itl_ms_p50']:.1f} ms"
        )
    cpu_s = {side: mean_cpu(rounds[traced]) for side, traced in (("off", False), ("on", True))}
    print("CPU seconds per round:", cpu_s)
    failed = sum(s["num_failed"] for side in rounds.values() for s in side)
    summary = {
        "levels": levels,
        "ratio": ratio,
        "ratio_mean": ratio_mean,
        "ratio_min": min(ratio.values()),
        "cpu_s": cpu_s,
        "spans_received": receiver.num_spans,
        "num_failed": failed,
    }
    print(json.dumps(summary))
    return 0 if failed == 0 and receiver.num_spans else 1


if __name__ == "__main__":
    sys.exit(main())
