"""What the report says about the machine and the code: the CPU's model and ISA flags, the
cores this process may use and the threads each engine gets, the load average, the CPU time
used over an interval by the engines' process groups, by this process and by everything else
(the machine may be shared: other processes' CPU time during a timed run says how far to trust
it), and shoal's git revision."""

from __future__ import annotations

import os
import resource
import subprocess
from dataclasses import dataclass
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


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (user, nice, system, irq, softirq) since
    boot, all CPUs together."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class CpuSnapshot:
    """CPU seconds so far: the machine's, this process's and each watched process group's."""

    machine: float
    self: float
    groups: dict[int, float]

    @classmethod
    def take(cls, pgids: list[int]) -> CpuSnapshot:
        return cls(busy_cpu_s(), self_cpu_s(), {pgid: group_cpu_s(pgid) for pgid in pgids})

    def since(self, before: CpuSnapshot) -> CpuSnapshot:
        groups = {g: t - before.groups.get(g, 0.0) for g, t in self.groups.items()}
        return CpuSnapshot(self.machine - before.machine, self.self - before.self, groups)

    def others(self) -> float:
        """Of an interval (``since``): what neither this process nor a watched group used."""
        return max(0.0, self.machine - self.self - sum(self.groups.values()))


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
