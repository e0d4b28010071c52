"""A CPU worker's weights and KV cache on transparent huge pages (``workers/huge_pages.py``),
read back from the kernel's accounting of a fresh worker process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ROOT = Path(__file__).resolve().parents[2]

# Loads a runner with a KV cache of tens of MiB in a fresh process; prints the kernel's count of
# anonymous huge-page memory in it, and what the environment said.
LOAD = """
import json, os, sys
from tests.golden.driver import make_runner
runner = make_runner(sys.argv[1], num_blocks=16384, block_size=16, dtype="float32")
runner.load()
kv_bytes = sum(t.numel() * t.element_size() for t in runner.kv_cache.k + runner.kv_cache.v)
rollup = open("/proc/self/smaps_rollup").read().splitlines()
huge_kb = next(int(line.split()[1]) for line in rollup if line.startswith("AnonHugePages"))
print(json.dumps({"huge_kb": huge_kb, "kv_bytes": kv_bytes,
                  "env": os.environ.get("THP_MEM_ALLOC_ENABLE")}))
"""


def thp_allowed() -> bool:
    try:
        mode = THP_MODE.read_text()
    except OSError:
        return False
    return "[never]" not in mode and Path("/proc/self/smaps_rollup").exists()


def load_in_a_fresh_process(model_dir: Path, **env: str) -> dict[str, object]:
    environ = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run(
        [sys.executable, "-c", LOAD, str(model_dir)],
        env={**environ, "OMP_NUM_THREADS": "1", **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.skipif(not thp_allowed(), reason="the kernel's THP mode is never (or unknown)")
def test_a_cpu_worker_backs_its_kv_cache_with_huge_pages(tiny_checkpoint):  # type: ignore[no-untyped-def]
    loaded = load_in_a_fresh_process(tiny_checkpoint("llama"))
    assert loaded["env"] == "1"
    assert loaded["kv_bytes"] >= 32 << 20
    assert loaded["huge_kb"] * 1024 >= loaded["kv_bytes"] // 2  # type: ignore[operator]


@pytest.mark.skipif(not thp_allowed(), reason="the kernel's THP mode is never (or unknown)")
def test_an_operator_can_keep_small_pages(tiny_checkpoint):  # type: ignore[no-untyped-def]
    loaded = load_in_a_fresh_process(tiny_checkpoint("llama"), THP_MEM_ALLOC_ENABLE="0")
    assert loaded["env"] == "0"
    assert loaded["huge_kb"] == 0
