"""The canonical layout across tensor-parallel sizes, every actor in its own process over a real
nats-server, one filesystem path shared by deployments run one after the other, each starting
with an empty CPU tier (loads are promoted from disk: the tiers' counters show it):

- TP=2 answers the first turns of some conversations (its chunks cascade to disk), stopped;
- TP=1 answers their returning turns with the tokens of recompute, loading TP=2's chunks, and
  the first turns of new conversations, stopped;
- TP=2 answers the new conversations' returning turns, loading the chunks only TP=1 wrote.

The model's two KV heads are split over the TP=2 ranks (the unit tests also cover replicated
heads, whose ranks take turns writing). With ``canonical_layout`` off, TP=1 loads nothing TP=2
stored (the same first two deployments)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from shoal.bus.codec import Codec
from shoal.bus.messages.control import Heartbeat
from shoal.bus.messages.engine import SchedulerStats
from shoal.bus.subjects import Subjects
from shoal.bus.transport.memory import InMemoryBroker, InMemoryBus
from tests.fixtures.models import make_prompts
from tests.integration.async_workload import complete, greedy
from tests.integration.conditions import wait_for
from tests.integration.engine_stack import engine_stack
from tests.integration.offload_workload import BLOCK_SIZE, FIRST_TURNS, MAX_TOKENS, NUM_BLOCKS
from tests.integration.process_deployment import PublishedStats, process_deployment
from tests.integration.test_offload_processes import CPU_TIER, make_config

pytestmark = [pytest.mark.timeout(300), pytest.mark.asyncio]

FS_TIER = f"{CPU_TIER}-fs0"
NEW_TURNS = make_prompts((120, 136, 104), seed=13)
Turns = list[list[int]]
Settled = Callable[[PublishedStats, "TierBeats"], bool]


def num_chunks(prompts: list[list[int]]) -> int:
    """The full chunks (one block each) of ``prompts``: what their first turns store."""
    return sum(len(prompt) // BLOCK_SIZE for prompt in prompts)


async def answer(client: Any, prompts: list[list[int]], tag: str) -> Turns:
    """Each prompt alone, one after the other."""
    outputs = []
    for i, prompt in enumerate(prompts):
        final = await complete(client, prompt, greedy(MAX_TOKENS), f"{tag}-{i}")
        outputs.append(list(final.outputs[0].token_ids))
    return outputs


def returning(prompts: list[list[int]], answers: Turns) -> list[list[int]]:
    """Each conversation returns: its first turn, the answer and a few new tokens."""
    return [
        [*p, *a, 40 + i, 41, 42, 43] for i, (p, a) in enumerate(zip(prompts, answers, strict=True))
    ]


async def recompute(model_dir: Path, prompts: list[list[int]]) -> tuple[Turns, Turns]:
    """First and returning turns with offload off, in this process."""
    bus = InMemoryBus(InMemoryBroker())
    await bus.connect()
    try:
        async with engine_stack(
            bus, model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_batched_tokens=256
        ) as built:
            first = await answer(built.client, prompts, "t1")
            return first, await answer(built.client, returning(prompts, first), "t2")
    finally:
        await bus.close()


class TierBeats:
    """Each tier actor's latest heartbeat figures."""

    def __init__(self) -> None:
        self.load: dict[str, dict[str, float]] = {}
        self._codec: Codec[Heartbeat] = Codec(Heartbeat)

    async def on_msg(self, msg: Any) -> None:
        beat = self._codec.decode(msg.data)
        self.load[beat.actor_id] = beat.load

    def figure(self, actor_id: str, name: str) -> float:
        return self.load.get(actor_id, {}).get(name, 0.0)

    def num_promoted(self) -> float:
        """Chunks the filesystem tier read and the CPU tier took (the lesser count)."""
        return min(self.figure(CPU_TIER, "num_promoted"), self.figure(FS_TIER, "num_chunks_loaded"))

    def all_cascaded(self) -> bool:
        """Every chunk the CPU tier holds and did not promote was written to disk (nothing is
        evicted from its 512 slots here)."""
        held = self.figure(CPU_TIER, "num_chunks") - self.figure(CPU_TIER, "num_promoted")
        return held > 0 and self.figure(CPU_TIER, "num_cascaded") >= held


def settled(*, num_finished: int, num_promoted: int = 0, cascaded: bool = False) -> Settled:
    """The deployment finished that many requests, promoted that many chunks from disk and, if
    ``cascaded``, wrote every chunk it stored to disk."""
    return lambda published, beats: (
        published.num_finished() >= num_finished
        and beats.num_promoted() >= num_promoted
        and (not cascaded or beats.all_cascaded())
    )


async def deployed(
    nats_url: str,
    config: Any,
    work: Callable[[Any], Awaitable[Any]],
    until: Settled,
) -> tuple[Any, SchedulerStats, TierBeats]:
    """``work(client)`` on a deployment of ``config``; what it returned, the engine core's stats
    and the tiers' figures once ``until`` holds."""
    from shoal.deploy.local import free_tcp_port

    tp_size = config.parallel_config.tensor_parallel_size
    init = [f"tcp://127.0.0.1:{free_tcp_port()}"] if tp_size > 1 else None
    async with process_deployment(nats_url, config, tp_init_methods=init) as deployment:
        beats = TierBeats()
        namespace = config.bus_config.namespace
        await deployment.client.bus.subscribe(Subjects(namespace).heartbeat("tier"), beats.on_msg)
        result = await work(deployment.client)
        published = deployment.published
        await wait_for(lambda: until(published, beats), 30, "the counters settled")
        return result, published.stats, beats


def deployment_config(model_dir: Path, fs_dir: Path, name: str, tp: int, canonical: bool) -> Any:
    extra = {"canonical_layout": canonical}
    return make_config(model_dir, f"canon-{name}", fs_dir, extra, tensor_parallel_size=tp)


async def test_tp2_stores_tp1_loads_and_tp1_stores_tp2_loads(  # type: ignore[no-untyped-def]
    nats_url, tiny_checkpoint, tmp_path
) -> None:
    model_dir = tiny_checkpoint("llama")
    old_first, old_back = await recompute(model_dir, FIRST_TURNS)
    new_first, new_back = await recompute(model_dir, NEW_TURNS)

    stored = settled(num_finished=len(FIRST_TURNS), cascaded=True)
    tp2_first, _, _ = await deployed(
        nats_url,
        deployment_config(model_dir, tmp_path, "a", 2, True),
        lambda client: answer(client, FIRST_TURNS, "a"),
        stored,
    )
    assert tp2_first == old_first

    async def tp1_work(client: Any) -> tuple[Turns, Turns]:
        back = await answer(client, returning(FIRST_TURNS, tp2_first), "b-back")
        return back, await answer(client, NEW_TURNS, "b-new")

    min_loaded = 8 * len(FIRST_TURNS)  # at least 8 blocks of each returning prefix
    (tp1_back, tp1_new), stats, _ = await deployed(
        nats_url,
        deployment_config(model_dir, tmp_path, "b", 1, True),
        tp1_work,
        settled(
            num_finished=len(FIRST_TURNS) + len(NEW_TURNS),
            num_promoted=min_loaded,
            cascaded=True,
        ),
    )
    assert (tp1_back, tp1_new) == (old_back, new_first)
    assert stats.kv_offload_hits >= min_loaded * BLOCK_SIZE and stats.kv_offload_load_bytes > 0

    tp2_back, stats, _ = await deployed(
        nats_url,
        deployment_config(model_dir, tmp_path, "c", 2, True),
        lambda client: answer(client, returning(NEW_TURNS, tp1_new), "c-back"),
        settled(num_finished=len(NEW_TURNS), num_promoted=num_chunks(NEW_TURNS)),
    )
    assert tp2_back == new_back
    assert stats.kv_offload_hits >= num_chunks(NEW_TURNS) * BLOCK_SIZE
    assert {p.parent.parent.name for p in tmp_path.rglob("*.bin")} == {"canonical"}


async def test_without_the_canonical_layout_tp1_does_not_load_what_tp2_stored(  # type: ignore[no-untyped-def]
    nats_url, tiny_checkpoint, tmp_path
) -> None:
    model_dir = tiny_checkpoint("llama")
    first, back = await recompute(model_dir, FIRST_TURNS)
    stored = settled(num_finished=len(FIRST_TURNS), cascaded=True)
    tp2_first, _, _ = await deployed(
        nats_url,
        deployment_config(model_dir, tmp_path, "off-a", 2, False),
        lambda client: answer(client, FIRST_TURNS, "a"),
        stored,
    )
    assert tp2_first == first
    tp1_back, stats, beats = await deployed(
        nats_url,
        deployment_config(model_dir, tmp_path, "off-b", 1, False),
        lambda client: answer(client, returning(FIRST_TURNS, tp2_first), "b-back"),
        settled(num_finished=len(FIRST_TURNS)),
    )
    assert tp1_back == back
    assert stats.kv_offload_queries > 0 and stats.kv_offload_hits == 0
    assert beats.num_promoted() == 0
    parts = {p.parent.parent.name for p in tmp_path.rglob("*.bin")}
    assert parts == {"tp2_r0", "tp2_r1", "tp1_r0"}
