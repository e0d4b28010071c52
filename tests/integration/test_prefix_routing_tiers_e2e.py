"""Prefix routing weighs a host's CPU tier, through real engine cores (tiny model) on the
in-memory bus and a real nats-server: two hosts of one namespace (``offload_hosts``: each its
own CPU tier, worker and engine core) and an engine client in kv routing mode. A long prompt
served on host A is stored in A's CPU tier; later requests push it out of A's device cache.
While A runs another request (by load alone B would win), the prompt returns with a suffix: the
client sends it to A, whose engine core loads the prefix from its CPU tier, and the greedy
output is transformers'."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from shoal.bus.messages.sampling import SamplingParams
from shoal.engine.client.engine_client import AsyncEngineClient
from tests.integration.conditions import wait_for
from tests.integration.offload_hosts import REPLY_S, start_host
from tests.integration.offload_workload import BLOCK_SIZE, FIRST_TURNS, MAX_TOKENS
from tests.integration.test_prefix_routing_e2e import record_picks

pytestmark = pytest.mark.timeout(240)

PROMPT, OTHERS = FIRST_TURNS[0], FIRST_TURNS[1:]  # each evicts the one two before it
ASKED = [*PROMPT, 40, 41, 42, 43, 44]
MIN_TIER_BLOCKS = len(PROMPT) // BLOCK_SIZE - 1  # its full blocks, a chunk's worth aside
BUSY_PROMPT, BUSY_TOKENS = list(range(3, 11)), 120  # 8 blocks: A's device holds it and ASKED


async def generate(client: AsyncEngineClient, tokens: list[int]) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    final = None
    async for output in client.generate(tokens, params, f"r-{uuid.uuid4().hex[:8]}"):
        final = output
    assert final is not None and final.finished
    return list(final.outputs[0].token_ids)


async def test_a_prefix_in_a_hosts_cpu_tier_draws_its_request_there(
    bus_factory,  # type: ignore[no-untyped-def]
    tiny_checkpoint,
    hf_reference,
) -> None:
    model_dir: Path = tiny_checkpoint("llama")
    want = hf_reference(model_dir, [ASKED], MAX_TOKENS)
    bus = await bus_factory()
    namespace = f"ptier{uuid.uuid4().hex[:8]}"
    a, b = [
        await start_host(bus, model_dir, namespace, name, secondary_tiers=(), routing_mode="kv")
        for name in ("ha", "hb")
    ]
    client = AsyncEngineClient(bus, a.config)
    try:
        await client.start()
        await client.wait_until_ready(30, 2)
        routing = client.prefix_routing
        assert routing is not None
        index, hashes = routing.index, routing.block_hashes(ASKED)
        await a.turn("prompt", PROMPT)
        for i, other in enumerate(OTHERS):
            await a.turn(f"other-{i}", other)
        await a.settled_stats()
        cpu_tier = a.tier("CpuTierActor").actor_id

        def out_of_device_in_tier() -> bool:
            in_tier = index.num_cached_blocks(cpu_tier, hashes, "cpu")
            return not index.num_cached_blocks(a.engine_id, hashes) and in_tier >= MIN_TIER_BLOCKS

        await wait_for(out_of_device_in_tier, REPLY_S, "the prompt left A's device, not its tier")
        hits = a.engine.core.stats().kv_offload_hits  # type: ignore[union-attr]
        await a.client.add(a.engine_id, "busy", BUSY_PROMPT, BUSY_TOKENS)
        view = client.router.engines[a.engine_id]
        await wait_for(lambda: view.load >= 1, REPLY_S, "A's load, reported")
        picks = record_picks(client)
        got = await generate(client, ASKED)
        assert a.client.final("busy") is None  # A was busier than B all along
        assert picks == [a.engine_id]
        loaded = a.engine.core.stats().kv_offload_hits - hits  # type: ignore[union-attr]
        assert loaded >= MIN_TIER_BLOCKS * BLOCK_SIZE  # the prefix came from A's CPU tier
        assert [got] == want
        assert not b.engine.core.stats().num_running  # type: ignore[union-attr]
    finally:
        await client.close()
        await b.stop()
        await a.stop()
