"""Stored responses outlive the gateway that made them: every actor in its own process on a real
nats-server, two gateway processes; a response created through the first (HTTP) is continued by
``previous_response_id`` through the second after the first was SIGKILLed, with the official
``openai`` SDK, and its answer equals chat completions' for the whole conversation; the second
gateway's NATS API fetches the stored response too."""

from __future__ import annotations

import json
import os
import signal

import openai
import pytest

from shoal.bus import connect_bus
from shoal.bus.runtime.supervisor import ActorSpec
from shoal.bus.streams import request_stream
from shoal.bus.subjects import Subjects
from shoal.deploy.deployment import GATEWAY_TARGET, build_config
from shoal.deploy.local import free_tcp_port
from tests.integration.conditions import wait_http_ready
from tests.integration.process_deployment import process_deployment
from tests.integration.served_stack import with_chat_template

pytestmark = [pytest.mark.timeout(300), pytest.mark.nats, pytest.mark.slow]
NAMESPACE = "respproc"


async def test_a_response_is_continued_through_another_gateway_process_after_the_first_died(
    nats_server, tiny_checkpoint, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    model_dir = with_chat_template(tiny_checkpoint("llama"), tmp_path / "model")
    config = build_config(
        model=str(model_dir), namespace=NAMESPACE, served_model_name="tiny", dtype="float32",
        num_gpu_blocks_override=128, max_num_seqs=4,
    )  # fmt: skip
    async with process_deployment(nats_server.url, config) as deployed:
        urls = []
        for n in range(2):
            port = free_tcp_port()
            kwargs = {"actor_id": f"gateway-{n}", "config": config, "port": port}
            spec = ActorSpec(
                f"gateway-{n}", GATEWAY_TARGET, nats_server.url, kwargs, kind="gateway"
            )
            deployed.supervisor.add(spec)
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            await wait_http_ready(url, 120)
        first, second = (
            openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) for url in urls
        )
        opening = await first.responses.create(
            model="tiny", input="the quick brown fox", max_output_tokens=8, temperature=0
        )
        pid = deployed.supervisor.pid("gateway-0")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)  # what it kept in its memory is gone with it
        continued = await second.responses.create(
            model="tiny", input="and then?", previous_response_id=opening.id,
            max_output_tokens=8, temperature=0,
        )  # fmt: skip
        whole = await second.chat.completions.create(
            model="tiny", max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": "the quick brown fox"},
                      {"role": "assistant", "content": opening.output_text},
                      {"role": "user", "content": "and then?"}],
        )  # fmt: skip
        assert continued.output_text == whole.choices[0].message.content
        assert continued.previous_response_id == opening.id
        bus = await connect_bus(nats_server.url)
        try:
            subject = Subjects(NAMESPACE).api("responses_get")
            payload = json.dumps({"response_id": opening.id}).encode()
            (fetched,) = [
                json.loads(m.data) async for m in request_stream(bus, subject, payload, timeout=30)
            ]
        finally:
            await bus.close()
        assert fetched["id"] == opening.id
        assert fetched["output"][0]["content"][0]["text"] == opening.output_text
