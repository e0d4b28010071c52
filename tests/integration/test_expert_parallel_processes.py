"""Expert parallelism across two data-parallel ranks, every actor in its own process over a real
nats-server: two engine cores in lock-step, each with one worker holding half of every MoE
layer's experts. Greedy outputs equal transformers' with one rank idle while the other serves
(its worker runs dummy steps for the collectives), with both serving a batch of prefill chunks
and decodes mixed, with dual-batch overlap splitting steps into micro-batches, and with n-gram
speculative decoding verifying drafts in the split steps too."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from shoal.bus.codec import Codec
from shoal.bus.messages.control import Heartbeat
from shoal.bus.subjects import Subjects
from shoal.deploy.deployment import build_config
from shoal.deploy.local import free_tcp_port
from tests.fixtures.models import make_prompts
from tests.integration.async_workload import complete, greedy
from tests.integration.conditions import wait_for
from tests.integration.process_deployment import process_deployment

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.nats,
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="module"),
]
OPTIONS = {"num_gpu_blocks_override": 128, "max_num_seqs": 16, "max_num_batched_tokens": 64}
DBO = {"enable_dbo": True, "dbo_decode_token_threshold": 2, "dbo_prefill_token_threshold": 8}
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
PROMPTS = make_prompts((5, 90, 12, 33, 7, 20), seed=11)  # 90 tokens: two chunks at 64
MAX_TOKENS = 8


class Beats:
    """Each worker's and engine core's latest heartbeat figures."""

    def __init__(self) -> None:
        self.load: dict[str, dict[str, float]] = {}
        self.num_beats = 0
        self._codec: Codec[Heartbeat] = Codec(Heartbeat)

    async def on_msg(self, msg: Any) -> None:
        beat = self._codec.decode(msg.data)
        self.load[beat.actor_id] = beat.load
        self.num_beats += 1

    def figure(self, name: str) -> dict[str, float]:
        return {worker: load[name] for worker, load in self.load.items() if name in load}


async def generate_all(client: Any, prompts: list[list[int]], tag: str) -> list[list[int]]:
    finals = await asyncio.gather(
        *(complete(client, p, greedy(MAX_TOKENS), f"{tag}{i}") for i, p in enumerate(prompts))
    )
    return [list(f.outputs[0].token_ids) for f in finals]


@pytest.mark.parametrize(
    ("variant", "extra"),
    [
        ("mixtral", {}),
        ("mixtral", DBO),
        ("qwen2_moe", DBO),
        ("qwen3_moe", {}),
        ("qwen3_moe", {**DBO, "speculative_config": NGRAM}),
    ],
    ids=["mixtral", "mixtral-dbo", "qwen2_moe-dbo", "qwen3_moe", "qwen3_moe-dbo-ngram"],
)
async def test_greedy_outputs_equal_transformers(  # type: ignore[no-untyped-def]
    nats_server, tiny_checkpoint, hf_reference, variant, extra
) -> None:
    model_dir = tiny_checkpoint(variant)
    namespace = f"ep-{variant.replace('_', '-')}-{len(extra)}"
    config = build_config(
        model=str(model_dir),
        namespace=namespace,
        data_parallel_size=2,
        enable_expert_parallel=True,
        **OPTIONS,
        **extra,
    )
    want = hf_reference(model_dir, PROMPTS, MAX_TOKENS)
    ep_init = f"tcp://127.0.0.1:{free_tcp_port()}"
    async with process_deployment(nats_server.url, config, ep_init_method=ep_init) as deployed:
        client = deployed.client
        beats = Beats()
        for kind in ("worker", "engine"):
            await client.bus.subscribe(Subjects(namespace).heartbeat(kind), beats.on_msg)
        alone = await generate_all(client, PROMPTS[:1], "alone")  # the other rank idles
        assert alone == want[:1]
        assert await generate_all(client, PROMPTS, "batch") == want
        await assert_idle_deployment_sleeps(beats)
        split = beats.figure("num_split_steps")
        if extra:
            assert all(n > 0 for n in split.values()), split
        else:
            assert set(split.values()) == {0.0}


async def assert_idle_deployment_sleeps(beats: Beats) -> None:
    """With every request done, the engine cores' lock-step rounds and the workers' steps stop
    (no busy dummy steps): their counts are equal across ten heartbeats, once the last steps in
    flight have landed."""

    def counts() -> dict[str, float]:
        return {**beats.figure("num_steps"), **beats.figure("num_lockstep_rounds")}

    async def ten_more_beats() -> None:
        seen = beats.num_beats
        await wait_for(lambda: beats.num_beats >= seen + 10, 30, "ten more heartbeats")

    await ten_more_beats()  # the last steps in flight land
    before = counts()
    await ten_more_beats()
    assert len(before) == 4 and counts() == before
