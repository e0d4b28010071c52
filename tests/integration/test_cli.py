"""The ``shoal`` command line: bad flags exit with status 2 and a clear message; ``shoal serve``
starts a whole local deployment in a subprocess, answers, and stops cleanly on Ctrl-C (SIGINT
to its process group) or SIGTERM, leaving no process behind; it answers again after its
embedded nats-server is killed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

SHOAL = [sys.executable, "-m", "shoal.deploy.cli"]
REPO = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SHOAL, *args], capture_output=True, text=True, timeout=120, cwd=REPO, check=False
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["serve", "--max-num-seqs", "0"], "max-num-seqs"),
        (["serve", "--port", "http"], "--port"),
        (["serve", "/no/such/model"], "model directory not found"),
        (["serve", "--dtype", "float8"], "--dtype"),
        (["serve", "--bus", "carrier-pigeon"], "--bus"),
        (["frobnicate"], "invalid choice"),
        (["bench", "no-such-bench"], "unknown benchmark"),
        (["actor", "worker"], "model"),
    ],
)
def test_bad_flags_exit_with_status_2(args: list[str], message: str) -> None:
    result = _run(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


def test_help_lists_the_commands() -> None:
    result = _run("--help")
    assert result.returncode == 0
    for command in ("serve", "generate", "actor", "bench"):
        assert command in result.stdout


def test_http_flags_reach_the_gateway(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    from shoal.deploy.actors import actor_target
    from shoal.deploy.cli import build_parser
    from shoal.deploy.deployment import build_config

    model = str(tiny_checkpoint("llama"))
    config = build_config(model=model)
    flags = ["actor", "gateway", model, "--port", "0", "--api-key", "k"]
    _, given = actor_target("gateway", config, None, build_parser().parse_args(flags))
    _, keep_alive = actor_target(
        "gateway", config, None, build_parser().parse_args([*flags, "--sse-keep-alive-s", "2"])
    )
    assert given["port"] == 0 and given["api_key"] == "k"
    assert "sse_keep_alive_s" not in given  # the gateway's own default
    assert keep_alive["sse_keep_alive_s"] == 2.0


def _serve(model_dir: Path) -> subprocess.Popen[str]:
    """``shoal serve`` on a free port in its own process group, output on one pipe."""
    return subprocess.Popen(
        [*SHOAL, "serve", str(model_dir), "--port", "0", "--num-gpu-blocks-override", "64"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        start_new_session=True,
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """The pids still alive after waiting (bounded) for them to exit and be reaped."""
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)  # paces the polling
    return [pid for pid in pids if _alive(pid)]


def _wait_for_line(proc: subprocess.Popen[str], pattern: str, lines: list[str], timeout: float):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        lines.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    raise AssertionError(f"no line matching {pattern!r}; output:\n{''.join(lines)}")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["sigint-group", "sigterm"])
def test_serve_starts_answers_and_stops_cleanly(tiny_checkpoint, how: str) -> None:  # type: ignore[no-untyped-def]
    model_dir = tiny_checkpoint("llama")
    proc = _serve(model_dir)
    lines: list[str] = []
    try:
        match = _wait_for_line(proc, r"is serving .* on (http://\S+)", lines, 240)
        url = match.group(1)
        text = "".join(lines)
        child_pids = [int(p) for p in re.findall(r"running \(pid (\d+)\)", text)]
        server_pids = [int(p) for p in re.findall(r"nats-server pid (\d+)", text)]
        # worker, engine core and (fault tolerance is on by default) the recovery controller
        assert len(child_pids) == 3 and len(server_pids) == 1, text
        body = json.dumps({"model": str(model_dir), "prompt": "hi", "max_tokens": 3}).encode()
        request = urllib.request.Request(
            f"{url}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        assert answer["usage"]["completion_tokens"] == 3
        if how == "sigint-group":
            os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        else:
            proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, "".join(lines) + rest
        assert "Traceback" not in rest, rest
        leftovers = _wait_gone([*child_pids, *server_pids])
        assert not leftovers, f"processes left behind: {leftovers}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _complete(url: str, model: str, timeout: float) -> dict:  # type: ignore[type-arg]
    body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 3}).encode()
    request = urllib.request.Request(
        f"{url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


class _Output:
    """A process's merged stdout read by a thread (a full pipe would stall the process)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:  # type: ignore[no-untyped-def]
        for line in stream:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(pattern, self.text)
            if match:
                return match
            time.sleep(0.05)  # paces the polling
        raise AssertionError(f"no line matching {pattern!r}; output:\n{self.text}")

    def join(self, timeout: float) -> str:
        self._thread.join(timeout)
        return self.text


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_serve_answers_again_after_its_nats_server_is_killed(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    model_dir = tiny_checkpoint("llama")
    proc = _serve(model_dir)
    output = _Output(proc)
    try:
        url = output.wait_for(r"is serving .* on (http://\S+)", 240).group(1)
        assert _complete(url, str(model_dir), 60)["usage"]["completion_tokens"] == 3
        first = int(output.wait_for(r"nats-server pid (\d+)", 1).group(1))
        os.kill(first, signal.SIGKILL)
        answer, deadline = None, time.monotonic() + 60
        while answer is None:  # bounded: until a completion succeeds again
            assert time.monotonic() < deadline, output.text
            try:
                answer = _complete(url, str(model_dir), 30)
            except (urllib.error.URLError, TimeoutError, ConnectionError):
                time.sleep(0.2)  # a 503 while the actors reconnect: paces the retries
        assert answer["usage"]["completion_tokens"] == 3
        output.wait_for(r"nats-server restarted: pid \d+", 10)
        server_pids = re.findall(r"nats-server (?:restarted: )?pid (\d+)", output.text)
        assert len(server_pids) == 2, output.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, output.text
        text = output.join(10)
        assert "Traceback" not in text, text
        child_pids = [int(p) for p in re.findall(r"running \(pid (\d+)\)", text)]
        assert not _wait_gone([*child_pids, *map(int, server_pids)]), text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_actor_processes_join_an_existing_nats_deployment(nats_server, tiny_checkpoint):  # type: ignore[no-untyped-def]
    """``shoal actor worker`` and ``shoal actor engine`` on a shared NATS: a client elsewhere
    gets completions from them (the multi-host path, on one host)."""
    from shoal.bus import connect_bus
    from shoal.bus.messages.sampling import SamplingParams
    from shoal.config.deployment import ShoalConfig
    from shoal.engine.client.engine_client import AsyncEngineClient

    model_dir = str(tiny_checkpoint("llama"))
    common = ["--nats-url", nats_server.url, "--namespace", "cliactors"]
    common += ["--num-gpu-blocks-override", "64"]
    procs = [
        subprocess.Popen([*SHOAL, "actor", kind, model_dir, *common], cwd=REPO)
        for kind in ("worker", "engine")
    ]
    bus = await connect_bus(nats_server.url)
    config = ShoalConfig.from_options(model=model_dir, namespace="cliactors")
    client = AsyncEngineClient(bus, config)
    try:
        await client.start()
        await client.wait_until_ready(120)
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        outputs = [out async for out in client.generate("hello", params, "r1")]
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 5
    finally:
        await client.close()
        await bus.close()
        stop_actor_processes(procs)


def stop_actor_processes(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to each actor process; each must exit cleanly (status 0) within a minute."""
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        assert proc.wait(timeout=60) == 0


@pytest.mark.timeout(180)
def test_generate_prints_the_completion(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    from tests.fixtures.models import hf_greedy

    model_dir = tiny_checkpoint("llama")
    result = _run("generate", str(model_dir), "-p", "hello", "--max-tokens", "4",
                  "--log-level", "WARNING")  # fmt: skip
    assert result.returncode == 0, result.stderr
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = tokenizer.encode("hello")
    expected = hf_greedy(model_dir, [prompt], 4)[0]
    text = tokenizer.decode(expected, skip_special_tokens=True)
    if 2 in expected:  # the tiny model's eos ends the completion early
        text = tokenizer.decode(expected[: expected.index(2)], skip_special_tokens=True)
    assert result.stdout == text + "\n"


def test_cuda_graph_flags_reach_the_config(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    from shoal.deploy.arguments import config_from_namespace
    from shoal.deploy.cli import build_parser

    model = str(tiny_checkpoint("llama"))
    default = config_from_namespace(build_parser().parse_args(["serve", model]), model)
    flags = ["serve", model, "--enforce-eager", "--cuda-graph-sizes", "1", "2", "8"]
    given = config_from_namespace(build_parser().parse_args(flags), model)
    assert not default.model_config.enforce_eager and default.model_config.cuda_graph_sizes is None
    assert given.model_config.enforce_eager and given.model_config.cuda_graph_sizes == [1, 2, 8]
    assert _run("serve", model, "--cuda-graph-sizes", "0").returncode == 2


def test_lora_flags_reach_the_config(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    from shoal.config.lora import LoRAModule
    from shoal.deploy.arguments import config_from_namespace
    from shoal.deploy.cli import build_parser

    model = str(tiny_checkpoint("llama"))
    default = config_from_namespace(build_parser().parse_args(["serve", model]), model)
    assert not default.lora_config.enable_lora and default.lora_config.lora_modules == ()
    flags = [
        "serve", model, "--enable-lora", "--max-loras", "3", "--max-lora-rank", "32",
        "--max-cpu-loras", "6", "--lora-modules", "sql=/adapters/sql",
        '{"name": "chat", "path": "nats-object://chat", "base_model_name": "base"}',
    ]  # fmt: skip
    lora = config_from_namespace(build_parser().parse_args(flags), model).lora_config
    assert (lora.enable_lora, lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras) == (
        True, 3, 32, 6,
    )  # fmt: skip
    assert lora.lora_modules == (
        LoRAModule("sql", "/adapters/sql"),
        LoRAModule("chat", "nats-object://chat", "base"),
    )
    assert _run("serve", model, "--max-lora-rank", "12").returncode == 2  # not a vLLM rank
    assert _run("serve", model, "--lora-modules", "sql=/x").returncode == 2  # needs --enable-lora


def test_structured_outputs_config_reaches_the_gateway(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """vLLM's ``--structured-outputs-config '{"enable_in_reasoning": true}'``: a grammar then
    constrains the thinking too (the gateway's serving option); unknown keys or a backend
    shoal lacks are refused."""
    from shoal.deploy.arguments import config_from_namespace
    from shoal.deploy.cli import build_parser

    model = str(tiny_checkpoint("llama"))
    default = config_from_namespace(build_parser().parse_args(["serve", model]), model)
    assert not default.model_config.structured_in_reasoning
    flags = ["serve", model, "--reasoning-parser", "qwen3", "--structured-outputs-config",
             '{"enable_in_reasoning": true, "backend": "xgrammar"}']  # fmt: skip
    config = config_from_namespace(build_parser().parse_args(flags), model)
    assert config.model_config.structured_in_reasoning
    for bad in ('{"enable_in_reasoning": 1}', '{"backend": "outlines"}', '{"reasoning": true}'):
        assert _run("serve", model, "--structured-outputs-config", bad).returncode == 2
