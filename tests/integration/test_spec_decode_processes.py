"""Speculative decoding with every actor in its own process over a real nats-server (the
supervisor runs them), async scheduling on: the ``async_workload`` (mixed lengths, a chunked
long prompt, n > 1, stop strings and tokens inside accepted runs, prefix hits, an abort) gives the
same greedy outputs as a plain engine in one process, and the engine core's published stats
count accepted drafts (the model is ``build_markov_checkpoint``'s, whose outputs loop)."""

from __future__ import annotations

from typing import Any

import pytest
import pytest_asyncio

from shoal.deploy.deployment import build_config
from tests.integration.async_workload import (
    Results,
    complete,
    completions,
    greedy,
    run_all,
    run_in_one_process,
    settled_stats,
)
from tests.integration.process_deployment import process_deployment

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.nats,
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="module"),
]
NAMESPACE = "specprocs"
OPTIONS = {"num_gpu_blocks_override": 256, "max_num_seqs": 32, "max_num_batched_tokens": 64}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def deployment(nats_server, markov_checkpoint):  # type: ignore[no-untyped-def]
    config = build_config(
        model=str(markov_checkpoint),
        namespace=NAMESPACE,
        async_scheduling=True,
        speculative_config=NGRAM,
        **OPTIONS,
    )
    async with process_deployment(nats_server.url, config) as deployed:
        yield deployed.client, deployed.published


async def run_with_loops(client: Any) -> Results:
    """The async workload, then long greedy runs (the workload's are too short for the model's
    outputs to loop, so no n-gram draft would be accepted)."""
    results = await run_all(client)
    for i, prompt in enumerate(([40, 41, 42], [7] * 20)):
        results[f"loop{i}"] = completions(await complete(client, prompt, greedy(64), f"loop{i}"))
    return results


async def test_outputs_equal_a_plain_engine(deployment, markov_checkpoint):  # type: ignore[no-untyped-def]
    client, published = deployment
    want = await run_in_one_process(markov_checkpoint, OPTIONS, run_with_loops)
    got = await run_with_loops(client)
    # A sampled request draws differently when drafts are verified: it only has to finish.
    seeded_got, _ = got.pop("seeded"), want.pop("seeded")
    assert seeded_got[0][1] in ("stop", "length") and 0 < len(seeded_got[0][0]) <= 10
    assert got == want
    stats = await settled_stats(published)
    assert stats.spec_decode_num_drafts > 0
    assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert stats.num_finished_error == 0
    assert stats.num_free_blocks == OPTIONS["num_gpu_blocks_override"] - 1
