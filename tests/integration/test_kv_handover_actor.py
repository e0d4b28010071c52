"""The prefill side of disaggregated prefill through a real engine core and worker, on the
in-memory bus and on a real nats-server: an ``AddRequest`` with ``do_remote_decode`` gets its
first token (the same as a plain request's) and, in its final output, the KV blocks its prompt
holds; they stay allocated until a ``ReleaseKV`` on the engine core's inbox frees them."""

from __future__ import annotations

import pytest

from shoal.bus.codec import Codec, encode
from shoal.bus.messages.engine import (
    AddRequest,
    EngineCoreOutput,
    EngineOutbound,
    EngineOutputs,
    KVTransferParams,
    ReleaseKV,
)
from shoal.bus.messages.sampling import SamplingParams
from shoal.bus.msg import Msg
from tests.integration.conditions import wait_for
from tests.integration.engine_stack import engine_stack

pytestmark = pytest.mark.timeout(120)

BLOCK_SIZE, NUM_BLOCKS = 16, 64
PROMPT = [(11 * i + 5) % 250 + 3 for i in range(37)]  # three blocks of 16, the last partial
_OUT: Codec[EngineOutbound] = Codec(EngineOutbound)


async def test_a_prefill_for_remote_decode_holds_its_kv_until_released(
    bus_factory, tiny_checkpoint
) -> None:  # type: ignore[no-untyped-def]
    bus = await bus_factory()
    finals: dict[str, EngineCoreOutput] = {}

    async def collect(msg: Msg) -> None:
        message = _OUT.decode(msg.data)
        if isinstance(message, EngineOutputs):
            finals.update((o.request_id, o) for o in message.outputs if o.finish_reason)

    options = {"block_size": BLOCK_SIZE, "num_blocks": NUM_BLOCKS}
    async with engine_stack(bus, tiny_checkpoint("llama"), **options) as stack:
        (engine,) = stack.engines
        subjects = engine.subjects
        await bus.subscribe(subjects.engine_out("probe"), collect)
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        remote = KVTransferParams(do_remote_decode=True)
        for request_id, transfer in (("plain", None), ("prefill", remote)):
            add = AddRequest(request_id, PROMPT, params, "probe", 0.0, kv_transfer_params=transfer)
            await bus.publish(subjects.engine_in("e0"), encode(add))
            await wait_for(lambda r=request_id: r in finals, 30, f"{request_id} finishes")  # type: ignore[misc]
        held = finals["prefill"].kv_transfer_params
        assert held is not None and held.num_remote_tokens == len(PROMPT)
        assert len(held.remote_block_ids) == 3 and finals["plain"].kv_transfer_params is None
        assert finals["prefill"].new_token_ids == finals["plain"].new_token_ids
        core = engine.core
        assert core is not None and core.scheduler.handovers.num_holding == 1
        pool = core.scheduler.kv_cache_manager.block_pool
        assert not set(held.remote_block_ids) & set(pool.free_block_ids())
        await bus.publish(subjects.engine_in("e0"), encode(ReleaseKV(["prefill"])))
        await wait_for(lambda: core.scheduler.handovers.num_holding == 0, 30, "the release")
        assert set(held.remote_block_ids) <= set(pool.free_block_ids())
        assert core.scheduler.handovers.num_released == 1
