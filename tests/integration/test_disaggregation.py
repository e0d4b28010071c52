"""Disaggregated prefill end to end (issue 33), on the in-memory bus and on a real nats-server:
one prefill and one decode engine core, each with its worker. A request whose prompt is long
enough is prefilled on the prefill engine core, which holds its KV; the client streams its first
token and continues it on the decode engine core, whose worker pulls the held blocks out of the
prefill worker's exported cache; the prefill side is then released. Greedy outputs equal one
colocated engine core's, and the counters show what the feature did: holds made and released
on the prefill side, pulls and the tokens they carried on the decode side (the prompts, not
recomputed), short prompts kept local."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from shoal.bus.messages.engine import SchedulerStats
from shoal.bus.messages.sampling import SamplingParams
from shoal.engine.client.engine_client import AsyncEngineClient
from tests.integration.conditions import wait_for
from tests.integration.engine_stack import EngineStack, engine_stack

pytestmark = pytest.mark.timeout(180)

BLOCK_SIZE = 16
NUM_TOKENS = 12
THRESHOLD = 24  # prompts longer than this are prefilled remotely
LONG = [[(7 * i + 13 * j) % 240 + 5 for i in range(n)] for j, n in enumerate((37, 64, 90, 41))]
SHORT = [[(5 * i + j) % 200 + 7 for i in range(n)] for j, n in enumerate((9, 20))]
DISAGG = {
    "num_prefill": 1,
    "num_decode": 1,
    "max_local_prefill_length": THRESHOLD,
    "max_prefill_queue_size": 64,
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


async def generate(
    client: AsyncEngineClient,
    prompts: list[list[int]],
    tag: str,
    on_tokens: Callable[[int, int], None] | None = None,
    params: SamplingParams = GREEDY,
) -> list[list[int]]:
    """Every prompt's tokens under ``params``; ``on_tokens(i, n)``, where given, is told each time
    request i's streamed tokens come to n."""

    async def one(index: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for output in client.generate(prompt, params, f"{tag}-{index}"):
            tokens = list(output.outputs[0].token_ids)
            if on_tokens is not None:
                on_tokens(index, len(tokens))
        return tokens

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


async def settled(stack: EngineStack) -> list[SchedulerStats]:
    for engine in stack.engines:
        core = engine.core
        assert core is not None
        await wait_for(lambda c=core: not c.has_work(), 30, "the engine cores settle")  # type: ignore[misc]
    stats = [engine.stats() for engine in stack.engines]
    assert all(s is not None for s in stats)
    return stats  # type: ignore[return-value]


async def test_a_handed_over_request_reports_its_timeline(bus_factory, model_dir) -> None:  # type: ignore[no-untyped-def]
    """Its first token (prefill side), its handover, the decode engine core admitting it and the
    decode side's first token, in that order (the gateway's TTFT split); a local request has no
    handover."""
    bus = await bus_factory()
    async with engine_stack(
        bus, model_dir, num_engines=2, block_size=BLOCK_SIZE, namespace="timeline", **DISAGG
    ) as stack:
        for prompt, remote in ((LONG[0], True), (SHORT[0], False)):
            final = None
            async for output in stack.client.generate(prompt, GREEDY, f"split-{remote}"):
                final = output
            assert final is not None and final.metrics is not None
            m = final.metrics
            assert m.first_scheduled_time is not None and m.first_token_time is not None
            if not remote:
                assert m.handover_time is None and m.decode_scheduled_time is None
                continue
            assert m.handover_time is not None and m.decode_first_token_time is not None
            assert m.decode_scheduled_time is not None
            assert m.first_scheduled_time <= m.first_token_time <= m.handover_time
            assert m.handover_time <= m.decode_first_token_time
            assert m.first_scheduled_time < m.decode_scheduled_time


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint) -> Path:  # type: ignore[no-untyped-def]
    return tiny_checkpoint("llama")


async def reference(bus: Any, model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    async with engine_stack(bus, model_dir, block_size=BLOCK_SIZE, namespace="colocated") as stack:
        return await generate(stack.client, prompts, "ref")


@pytest.mark.parametrize("path", ["shared_memory", "tcp"])
async def test_long_prompts_are_prefilled_remotely_and_their_kv_pulled(
    bus_factory, model_dir, path
) -> None:  # type: ignore[no-untyped-def]
    """``tcp``: the decode worker believes it is on another host, so it reads every held block
    through the prefill worker's server instead of its shared memory."""
    bus = await bus_factory()
    expected = await reference(bus, model_dir, LONG + SHORT)
    async with engine_stack(
        bus, model_dir, num_engines=2, block_size=BLOCK_SIZE, namespace="disagg", **DISAGG
    ) as stack:
        assert [e.kv_role for e in stack.engines] == ["prefill", "decode"]
        if path == "tcp":
            stack.workers[1].runner.remote_caches.host = "another-boot-id:another-host"  # type: ignore[union-attr]
        assert await generate(stack.client, LONG + SHORT, "pd") == expected
        prefill, decode = await settled(stack)
        await wait_for(
            lambda: stack.engines[0].stats().kv_handover_released == len(LONG),  # type: ignore[union-attr]
            30,
            "every hold released",
        )
        prefill = stack.engines[0].stats()  # type: ignore[assignment]
    assert stack.client.disagg.num_remote == len(LONG)
    assert stack.client.disagg.num_local == len(SHORT)
    # The prefill side ran each long prompt and its first token, and held its KV until pulled.
    assert prefill.kv_handover_holds == len(LONG) and prefill.kv_handover_holding == 0
    assert prefill.num_prompt_tokens == sum(map(len, LONG))
    assert prefill.num_generation_tokens == len(LONG)
    # The decode side pulled every long prompt's KV (none recomputed) and computed the rest.
    assert decode.kv_pulls == len(LONG) and decode.kv_pull_failures == 0
    assert decode.kv_pulled_tokens == sum(map(len, LONG))
    assert decode.kv_pull_recomputed_tokens == 0
    block_bytes = (
        stack.workers[1].runner.kv_cache.num_bytes // stack.workers[1].runner.kv_cache.num_blocks
    )  # type: ignore[union-attr]
    assert decode.kv_pull_bytes == sum(-(-len(p) // BLOCK_SIZE) for p in LONG) * block_bytes
    assert decode.num_prompt_tokens == sum(map(len, LONG + SHORT))


async def test_a_pull_that_fails_is_recomputed_with_the_same_output(bus_factory, model_dir) -> None:  # type: ignore[no-untyped-def]
    bus = await bus_factory()
    expected = await reference(bus, model_dir, LONG)
    async with engine_stack(
        bus, model_dir, num_engines=2, block_size=BLOCK_SIZE, namespace="badpull", **DISAGG
    ) as stack:
        core = stack.engines[0].core
        assert core is not None
        exports = core.scheduler.handovers.exports
        assert len(exports) == 1
        forged = msgspec.structs.replace(exports[0], token="00" * 16)  # not that file's token
        core.set_kv_source("e0", [forged])
        assert await generate(stack.client, LONG, "bad") == expected
        _, decode = await settled(stack)
        await wait_for(
            lambda: stack.engines[0].stats().kv_handover_holding == 0,  # type: ignore[union-attr]
            30,
            "every hold released",
        )
    assert decode.kv_pulls == 0 and decode.kv_pull_failures == len(LONG)
    assert decode.kv_pull_recomputed_tokens == sum(map(len, LONG))
