"""Smoke test of the end-to-end throughput benchmark (``bench/throughput_e2e.py``): a short run
over NATS (actor processes), the in-memory bus and transformers ends with one JSON line of
positive figures. No timing is asserted; the machine is shared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "throughput_e2e.py"

pytestmark = [pytest.mark.timeout(300), pytest.mark.nats, pytest.mark.slow]


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


def test_quick_run_prints_the_figures_as_json_last():
    done = _run(str(BENCH), "--quick", "--num-prompts", "16", timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    figures = json.loads(lines[-1])
    for key in ("nats_tok_s", "memory_tok_s", "hf_tok_s", "nats_vs_memory", "nats_vs_hf"):
        assert isinstance(figures[key], int | float) and figures[key] > 0, (key, figures)
    for key in ("nats_bus_step_us", "memory_bus_step_us", "bus_added_step_us"):
        assert isinstance(figures[key], int | float), (key, figures)
    assert figures["nats_bus_step_us"] > 0 and figures["memory_bus_step_us"] > 0
    # Every requested token came back through both paths, with the whole workload resident.
    assert figures["num_prompts"] == 16 and figures["tokens"] >= 16 * 16
    assert figures["steps"] > 0 and figures["preemptions"] == 0


@pytest.mark.parametrize(
    ("name", "script"),
    [("throughput", "throughput_e2e.py"), ("runner-throughput", "throughput.py")],
)
def test_cli_bench_aliases(name: str, script: str):
    done = _run("-m", "shoal.deploy.cli", "bench", name, "--help", timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"usage: {script} ")
