"""Tracing's cost on ``bench/serve.py``: ``shoal serve`` (the default model unless ``--model``)
started afresh per side and round, tracing off and on (``--otlp-traces-endpoint`` to an
in-process OTLP/HTTP collector: every request traced, from the gateway to the worker), and the
same ``bench/serve.py`` sweep against each (``--concurrency`` levels, ``--max-tokens`` each).
Sides alternate over ``--rounds`` and each keeps its best round per level (the machines are
noisy: the rounds' mean throughput is given too). Prints each level side by side; the last line
is one JSON object: ``{"levels": [{"side": "off"|"on", "concurrency", "tok_s", "itl_ms_p50",
"ttft_ms_p50", "e2e_ms_p50"}], "ratio": {concurrency: on over off, best rounds},
"ratio_mean": {concurrency: on over off, mean of the rounds}, "ratio_min", "spans_received",
"num_failed"}``.

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
from bench.serve import sweep
from shoal.deploy.local import free_tcp_port
from tests.fixtures.otlp_receiver import HttpReceiver

EXPORT = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}


def serve_round(args: argparse.Namespace, endpoint: str | None) -> dict[str, Any]:
    """One fresh server (traced to ``endpoint`` when given) and the sweep's summary."""
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
        return asyncio.run(sweep(load, server))
    finally:
        stop(server)


def mean_tok_s(rounds: list[dict[str, Any]], concurrency: int) -> float:
    """The rounds' mean output tokens/s at ``concurrency``."""
    values = [lv["tok_s"] for s in rounds for lv in s["levels"] if lv["concurrency"] == concurrency]
    return sum(values) / len(values)


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
    failed = sum(s["num_failed"] for side in rounds.values() for s in side)
    summary = {
        "levels": levels,
        "ratio": ratio,
        "ratio_mean": ratio_mean,
        "ratio_min": min(ratio.values()),
        "spans_received": receiver.num_spans,
        "num_failed": failed,
    }
    print(json.dumps(summary))
    return 0 if failed == 0 and receiver.num_spans else 1


if __name__ == "__main__":
    sys.exit(main())
