"""The offline stage for one dtype: each engine's worker loaded in turn (one at a time, the
next only once the last is ready), an untimed warm-up each, then ``rounds`` timed rounds in
which every engine in turn runs the whole workload in one call and the single request (the
order rotated each round, so no engine always goes first), then the greedy outputs of the first
prompts. transformers, the reference and by far the slowest, times each of its static batch
sizes once, in the first round (a second round would add minutes for a figure that is not a
headline ratio). An engine that fails to load or dies is reported with its error and dropped;
the others go on. The idle engines are stopped (SIGSTOP) while one is timed and continued
after: a peer that polls while idle distorts the figures on a small machine (beside an idle
vLLM, shoal's offline rate fell ~15% on 2 cores). Each timed run records the CPU time the idle
engines used meanwhile (none, stopped) and that of every other process on the machine (someone
else's work)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from .engine_proc import EngineProcess, EngineSpec, WorkerError, paused
from .journal import journal
from .machine import CpuSnapshot
from .report import rate

T = TypeVar("T")
LOAD_TIMEOUT_S = 1800.0
RUN_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class OfflineSettings:
    """What every worker is told (``worker_config``) and how the stage runs."""

    model: str
    dtype: str
    threads: int
    prompts_file: str
    max_tokens: int
    max_model_len: int
    kv_bytes: int
    vllm_eager: bool
    rounds: int
    num_outputs: int
    hf_batches: list[int]

    def worker_config(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "dtype": self.dtype,
            "threads": self.threads,
            "prompts_file": self.prompts_file,
            "max_tokens": self.max_tokens,
            "max_model_len": self.max_model_len,
            "kv_bytes": self.kv_bytes,
            "eager": self.vllm_eager,
        }


@dataclass
class EngineRuns:
    """One engine's results in the stage (``error`` set when it failed)."""

    ready: dict[str, Any] = field(default_factory=dict)
    offline: list[dict[str, Any]] = field(default_factory=list)
    single: list[dict[str, Any]] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "load_s": self.ready.get("load_s"),
            "ready": self.ready,
            "offline_runs": self.offline,
            "single_runs": self.single,
            "error": self.error,
        }


class OfflineStage:
    """The engines of one dtype, loaded, measured and stopped."""

    def __init__(self, specs: list[EngineSpec], settings: OfflineSettings, run_dir: Path) -> None:
        self.specs, self.settings, self.run_dir = specs, settings, run_dir
        self.procs: dict[str, EngineProcess] = {}
        self.runs: dict[str, EngineRuns] = {spec.name: EngineRuns() for spec in specs}

    def run(self) -> dict[str, EngineRuns]:
        try:
            for spec in self.specs:
                self.start(spec)
            for name in list(self.procs):
                self.guarded(name, self.warm_up)
            for index in range(self.settings.rounds):
                self.run_round(index)
            for name in list(self.procs):
                self.guarded(name, self.collect_outputs)
        finally:
            for proc in self.procs.values():
                proc.close()
        return self.runs

    def start(self, spec: EngineSpec) -> None:
        tag = f"{spec.name}-{self.settings.dtype}"
        print(f"  loading {spec.name} ({self.settings.dtype}) ...", flush=True)
        proc = EngineProcess(spec, self.settings.worker_config(), self.run_dir, tag)
        self.procs[spec.name] = proc
        ready = self.guarded(spec.name, lambda p: p.wait_ready(LOAD_TIMEOUT_S))
        if ready is not None:
            self.runs[spec.name].ready = ready
            journal(self.run_dir, dtype=self.settings.dtype, engine=spec.name, ready=ready)
            print(f"  {spec.name} loaded in {ready['load_s']:.1f} s", flush=True)

    def guarded(self, name: str, step: Callable[[EngineProcess], T]) -> T | None:
        """``step(proc)``; on a worker error the engine is recorded as failed and stopped."""
        try:
            return step(self.procs[name])
        except WorkerError as exc:
            print(f"  {name} failed: {exc}", flush=True)
            self.runs[name].error = str(exc).splitlines()[0]
            journal(
                self.run_dir, dtype=self.settings.dtype, engine=name, error=self.runs[name].error
            )
            self.procs.pop(name).close()
            return None

    def warm_up(self, proc: EngineProcess) -> None:
        fields = {"batches": self.settings.hf_batches} if proc.name == "hf" else {}
        proc.call("warmup", RUN_TIMEOUT_S, **fields)

    def run_round(self, index: int) -> None:
        names = list(self.procs)
        shift = index % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            if name in self.procs:
                self.guarded(name, lambda proc: self.engine_round(proc, index))

    def engine_round(self, proc: EngineProcess, index: int) -> None:
        runs = self.runs[proc.name]
        if proc.name == "hf":
            for batch in self.settings.hf_batches if index == 0 else []:
                run = self.timed(proc, "offline", batch=batch)
                runs.offline.append({**run, "batch": batch})
                self.print_run(proc.name, f"offline b={batch}", run)
            return
        runs.offline.append(self.timed(proc, "offline"))
        self.print_run(proc.name, "offline", runs.offline[-1])
        runs.single.append(self.timed(proc, "single"))
        self.print_run(proc.name, "single", runs.single[-1])

    def timed(self, proc: EngineProcess, op: str, **fields: Any) -> dict[str, Any]:
        """One timed command, with the CPU time the idle engines and every other process on
        the machine used meanwhile."""
        pgids = [p.pgid for p in self.procs.values()]
        before = CpuSnapshot.take(pgids)
        with paused(pgid for pgid in pgids if pgid != proc.pgid):
            run = proc.call(op, RUN_TIMEOUT_S, **fields)
        used = CpuSnapshot.take(pgids).since(before)
        idle = sum(t for pgid, t in used.groups.items() if pgid != proc.pgid)
        timed = {
            **run,
            "cpu_s": round(used.groups[proc.pgid], 2),
            "idle_peer_cpu_s": round(idle, 2),
            "other_cpu_s": round(used.others(), 2),
        }
        journal(self.run_dir, dtype=self.settings.dtype, engine=proc.name, op=op, **timed)
        return timed

    def collect_outputs(self, proc: EngineProcess) -> None:
        reply = proc.call("outputs", RUN_TIMEOUT_S, num=self.settings.num_outputs)
        self.runs[proc.name].outputs = reply["token_ids"]

    @staticmethod
    def print_run(name: str, what: str, run: dict[str, Any]) -> None:
        notes = [
            f"{who} used {run[key]:.1f} CPU-s"
            for who, key in (("idle peers", "idle_peer_cpu_s"), ("other processes", "other_cpu_s"))
            if run[key] > 0.5
        ]
        note = f" ({'; '.join(notes)})" if notes else ""
        print(
            f"    {name:<6} {what:<14} {run['tokens']:6d} tokens in {run['seconds']:7.2f} s = "
            f"{rate(run):7.1f} tok/s{note}",
            flush=True,
        )
