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
STEP_TIMEOUT_S = 60.0
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


async def test_a_killed_rank_leaves_no_survivor_waiting(nats_server, tiny_checkpoint):  # type: ignore[no-untyped-def]
    config = build_config(
        model=str(tiny_checkpoint("mixtral")),
        namespace="ep-faults",
        data_parallel_size=2,
        enable_expert_parallel=True,
        step_timeout_s=STEP_TIMEOUT_S,
        num_gpu_blocks_override=256,
        max_num_seqs=8,
    )
    ep_init = f"tcp://127.0.0.1:{free_tcp_port()}"
    async with process_deployment(nats_server.url, config, ep_init_method=ep_init) as deployed:
        client, supervisor = deployed.client, deployed.supervisor
        streams = {f"long{i}": Stream(client, [5, 6, 7, 8 + i], f"long{i}") for i in range(4)}
        await wait_for(lambda: all(s.num_outputs for s in streams.values()), 60, "outputs")
        engines = {client.placements.placed()[r] for r in streams}
        assert engines == {"engine-0", "engine-1"}, engines  # both ranks serve
        pid = supervisor.pid("worker-1-0")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        finals = await asyncio.wait_for(
            asyncio.gather(*(s.task for s in streams.values())), STEP_TIMEOUT_S / 2
        )
        for request_id, final in zip(streams, finals, strict=True):
            assert final is not None and final.finished, request_id
            assert final.outputs[0].finish_reason == "error", (request_id, final)
            assert len(final.outputs[0].token_ids) < 900


async def test_with_fault_tolerance_the_group_is_rebuilt_and_requests_resume(  # type: ignore[no-untyped-def]
    nats_server, tiny_checkpoint, hf_reference
):
    """Fault tolerance on: the killed worker's restart and every engine core's retry rebuild
    the expert-parallel group under a new agreed epoch, the requests resume where their
    streams left off, and their greedy outputs equal transformers'."""
    model_dir = tiny_checkpoint("mixtral")
    config = build_config(
        model=str(model_dir),
        namespace="ep-ft",
        data_parallel_size=2,
        enable_expert_parallel=True,
        enable_fault_tolerance=True,
        recovery_backoff_s=0.2,
        num_gpu_blocks_override=256,
        max_num_seqs=8,
    )
    prompts = [[5, 6, 7, 8 + i] for i in range(4)]
    want = hf_reference(model_dir, prompts, MAX_TOKENS_FT)
    ep_init = f"tcp://127.0.0.1:{free_tcp_port()}"
    async with process_deployment(nats_server.url, config, ep_init_method=ep_init) as deployed:
        client, supervisor = deployed.client, deployed.supervisor
        streams = {
            f"ft{i}": Stream(client, p, f"ft{i}", MAX_TOKENS_FT) for i, p in enumerate(prompts)
        }
        await wait_for(lambda: all(s.num_outputs for s in streams.values()), 60, "outputs")
        assert {client.placements.placed()[r] for r in streams} == {"engine-0", "engine-1"}
        pid = supervisor.pid("worker-1-0")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        finals = await asyncio.wait_for(asyncio.gather(*(s.task for s in streams.values())), 120)
        got = [list(f.outputs[0].token_ids) for f in finals]
        assert [f.outputs[0].finish_reason for f in finals] == ["length"] * 4, finals
        assert got == want
        assert supervisor.num_restarts("worker-1-0") == 1
