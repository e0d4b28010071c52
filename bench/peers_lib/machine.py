"""What the report says about the machine and the code: the CPU's model and ISA flags, the
cores this process may use and the threads each engine gets, the load average (the machine may
be shared), the CPU time a process group has used, and shoal's git revision."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def cpuinfo_field(name: str) -> str:
    """The first ``name : value`` line of /proc/cpuinfo ('' when absent)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return ""


def isa_flags() -> dict[str, bool]:
    flags = set(cpuinfo_field("flags").split())
    return {flag: flag in flags for flag in ISA_FLAGS}


def affinity() -> list[int]:
    """The CPUs this process may run on."""
    return sorted(os.sched_getaffinity(0))


def thread_cpus(threads: int) -> list[int]:
    """The CPUs an engine that binds its threads (vLLM) gets: the first ``threads`` of ours."""
    return affinity()[:threads]


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def group_cpu_s(pgid: int) -> float:
    """User plus system CPU seconds of the live processes in process group ``pgid``."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid:  # fields after the command: state, ppid, pgrp, ...
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def git_rev(root: Path) -> str:
    """The short revision of ``root``'s checkout, ``+dirty`` when it has local changes."""
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return rev + ("+dirty" if dirty else "")


def machine_facts(threads: int) -> dict[str, object]:
    cpus = affinity()
    return {
        "cpu": cpuinfo_field("model name"),
        "isa": isa_flags(),
        "cpus": len(cpus),
        "affinity": cpus,
        "threads_per_engine": threads,
        "vllm_cpus": thread_cpus(threads),
        "load_average_at_start": load_average(),
    }
