"""A worker of an expert-parallel group SIGKILLed while both data-parallel ranks generate: the
surviving worker, blocked in the group's all-to-all, does not wait forever, and every request
of both engine cores ends (the killed rank's with a clean error) well within the step
timeout."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import pytest

from shoal.deploy.deployment import build_config
from shoal.deploy.local import free_tcp_port
from tests.integration.async_workload import greedy
from tests.integration.conditions import wait_for
from tests.integration.process_deployment import process_deployment

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.nats,
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="module"),
]
STEP_TIMEOUT_S = 60.0  # the no-FT test ends well within it: the all-to-all fails at once
MAX_TOKENS_FT = 120


class Stream:
    """One request read to its end in a task, counting its outputs."""

    def __init__(
        self, client: Any, prompt: list[int], request_id: str, max_tokens: int = 900
    ) -> None:
        self.num_outputs = 0
        self.task = asyncio.create_task(self._read(client, prompt, request_id, max_tokens))

    async def _read(self, client: Any, prompt: list[int], request_id: str, max_tokens: int) -> Any:
        final = None
        async for output in client.generate(prompt, greedy(max_tokens), request_id):
            self.num_outputs += 1
            final = output
        return final


PROMPTS = [[5, 6, 7, 8 + i] for i in range(4)]


def ep_config(model_dir: Any, namespace: str, **options: Any) -> Any:
    return build_config(
        model=str(model_dir),
        namespace=namespace,
        data_parallel_size=2,
        enable_expert_parallel=True,
        num_gpu_blocks_override=256,
        max_num_seqs=8,
        **options,
    )


async def kill_a_rank_under_load(
    deployed: Any, max_tokens: int, finish_within_s: float = 120
) -> list[Any]:
    """Requests generating on both ranks, then worker-1-0 SIGKILLed; their final outputs, each
    within ``finish_within_s`` of the kill (AssertionError naming the unfinished ones)."""
    client, supervisor = deployed.client, deployed.supervisor
    streams = [Stream(client, p, f"r{i}", max_tokens) for i, p in enumerate(PROMPTS)]
    await wait_for(lambda: all(s.num_outputs for s in streams), 60, "outputs")
    placed = client.placements.placed()
    engines = {placed[f"r{i}"] for i in range(len(streams))}
    assert engines == {"engine-0", "engine-1"}, engines  # both ranks serve
    pid = supervisor.pid("worker-1-0")
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    _, pending = await asyncio.wait([s.task for s in streams], timeout=finish_within_s)
    for task in pending:
        task.cancel()
    assert not pending, f"not finished {finish_within_s} s after the kill: " + ", ".join(
        f"r{i} on {placed[f'r{i}']} after {s.num_outputs} outputs"
        for i, s in enumerate(streams)
        if s.task in pending
    )
    return [s.task.result() for s in streams]


async def test_a_killed_rank_leaves_no_survivor_waiting(nats_server, tiny_checkpoint):  # type: ignore[no-untyped-def]
    config = ep_config(
        tiny_checkpoint("mixtral"), "ep-faults", step_timeout_s=STEP_TIMEOUT_S,
        enable_fault_tolerance=False,
    )  # fmt: skip
    ep_init = f"tcp://127.0.0.1:{free_tcp_port()}"
    async with process_deployment(nats_server.url, config, ep_init_method=ep_init) as deployed:
        # well before the step timeout: the all-to-all failed at once
        finals = await kill_a_rank_under_load(deployed, 900, finish_within_s=STEP_TIMEOUT_S / 2)
    for final in finals:
        assert final is not None and final.finished
        assert final.outputs[0].finish_reason == "error", final
        assert len(final.outputs[0].token_ids) < 900


async def test_with_fault_tolerance_the_group_is_rebuilt_and_requests_resume(  # type: ignore[no-untyped-def]
    nats_server, tiny_checkpoint, hf_reference
):
    """Fault tolerance on: the killed worker's restart and every engine core's retry rebuild
    the expert-parallel group under a new agreed epoch, the requests resume where their
    streams left off, and their greedy outputs equal transformers'."""
    model_dir = tiny_checkpoint("mixtral")
    config = ep_config(model_dir, "ep-ft", enable_fault_tolerance=True, recovery_backoff_s=0.2)
    want = hf_reference(model_dir, PROMPTS, MAX_TOKENS_FT)
    ep_init = f"tcp://127.0.0.1:{free_tcp_port()}"
    async with process_deployment(nats_server.url, config, ep_init_method=ep_init) as deployed:
        finals = await kill_a_rank_under_load(deployed, MAX_TOKENS_FT)
        assert [f.outputs[0].finish_reason for f in finals] == ["length"] * 4, finals
        assert [list(f.outputs[0].token_ids) for f in finals] == want
        assert deployed.supervisor.num_restarts("worker-1-0") == 1
