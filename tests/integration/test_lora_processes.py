"""LoRA adapters over the bus, every actor in its own process on a real nats-server: an adapter
pushed with ``shoal lora push`` (its folder then deleted: no shared filesystem) is fetched by
name by the worker of another process and applied (greedy outputs equal transformers with
PEFT's adapter), and the worker SIGKILLed mid-stream comes back, fetches it again and the
resumed requests still end with the calm outputs."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.bus.messages.lora import LoRARequest
from shoal.bus.messages.sampling import SamplingParams
from shoal.deploy.deployment import build_config
from tests.fixtures.lora import build_adapter, hf_lora_greedy
from tests.fixtures.models import make_prompts
from tests.integration.conditions import wait_for
from tests.integration.process_deployment import process_deployment

pytestmark = [pytest.mark.timeout(300), pytest.mark.nats, pytest.mark.slow]
MAX_TOKENS = 48
PROMPTS = make_prompts((9, 14, 6, 20), seed=9)
RESILIENT = {"enable_fault_tolerance": True, "enable_request_resumption": True}


def push(nats_url: str, namespace: str, name: str, folder: Path) -> str:
    shoal = Path(sys.executable).parent / "shoal"
    done = subprocess.run(
        [str(shoal), "lora", "push", name, str(folder), "--nats-url", nats_url,
         "--namespace", namespace],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


async def generate(client, lora: LoRARequest, tag: str) -> list[list[int]]:  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> list[int]:
        final = None
        async for output in client.generate(prompt, params, f"{tag}{i}", lora_request=lora):
            final = output
        assert final is not None and final.error is None, final
        return list(final.outputs[0].token_ids)

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))


async def test_a_pushed_adapter_is_fetched_by_a_worker_in_another_process_even_after_a_restart(
    nats_server, tiny_checkpoint, tmp_path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    model_dir = tiny_checkpoint("llama")
    adapter = build_adapter(model_dir, tmp_path / "src" / "a0", seed=50)
    expected = [hf_lora_greedy(model_dir, adapter, [p], MAX_TOKENS)[0] for p in PROMPTS]
    assert expected != hf_lora_greedy(model_dir, None, PROMPTS, MAX_TOKENS)
    said = push(nats_server.url, "lorapush", "a0", adapter)
    assert "nats-object://a0" in said
    shutil.rmtree(adapter)
    cache = tmp_path / "cache"
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(cache))  # the actor processes' cache
    config = build_config(
        model=str(model_dir), namespace="lorapush", dtype="float32",
        num_gpu_blocks_override=128, max_num_seqs=8, worker_dead_after_s=2.0,
        enable_lora=True, max_loras=2, **RESILIENT,
    )  # fmt: skip
    lora = LoRARequest("a0", 7, "nats-object://a0")
    async with process_deployment(nats_server.url, config) as deployed:
        client, supervisor = deployed.client, deployed.supervisor
        assert await generate(client, lora, "calm") == expected
        fetched = sorted(p.name for p in (cache / "lora").iterdir() if p.name.startswith("a0-"))
        assert len(fetched) == 1, fetched

        running = asyncio.ensure_future(generate(client, lora, "cut"))
        await wait_for(
            lambda: deployed.published.stats.num_generation_tokens > len(PROMPTS) * MAX_TOKENS + 8,
            60,
            "the second batch generating",
        )
        pid = supervisor.pid("worker-0-0")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        assert await asyncio.wait_for(running, 240) == expected
        assert client.resumptions.num_resumptions_total > 0
        assert supervisor.num_restarts("worker-0-0") >= 1
