"""The NATS cluster's flags: ``--nats-url`` takes several servers (comma-separated and/or
repeated, credentials refused), ``--jetstream-replicas`` reaches the JetStream buckets shoal
creates (the group-ports board, the object tier)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest

from shoal.bus.base import Bus
from shoal.bus.subjects import Subjects
from shoal.config.deployment import ShoalConfig
from shoal.deploy.cli import build_parser, main
from shoal.deploy.deployment import plan_tiers
from shoal.deploy.local import check_embedded_server
from shoal.workers import group_ports
from shoal.workers.group_ports import port_board_for


@pytest.mark.parametrize("command", [["serve"], ["actor", "engine", "model"]])
def test_several_nats_urls_become_one_comma_joined_list(command: list[str]) -> None:
    ns = build_parser().parse_args(
        [
            *command,
            "--nats-url",
            "nats://a:4222, nats://b:4222",
            "--nats-url",
            "nats://c:4222",
            "--nats-url",
            "nats://a:4222",  # again: kept once
        ]
    )
    assert ns.nats_url == "nats://a:4222,nats://b:4222,nats://c:4222"
    assert build_parser().parse_args(command).nats_url is None


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("nats://user:secret@a:4222", "SHOAL_NATS_PASSWORD"),
        ("http://a:4222", "nats://"),
        ("http://user:secret@a:4222", "nats://"),
        (" , ", "expected nats://"),
    ],
)
def test_a_bad_nats_url_is_refused_without_echoing_secrets(
    url: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--nats-url", url])
    err = capsys.readouterr().err
    assert message in err and "secret" not in err


def test_jetstream_replicas_flag_and_its_bounds() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve", "--jetstream-replicas", "3"]).jetstream_replicas == 3
    assert parser.parse_args(["serve"]).jetstream_replicas == 1
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--jetstream-replicas", "0"])
    with pytest.raises(ValueError, match="jetstream_replicas"):
        ShoalConfig.from_options(model="m", jetstream_replicas=7)


def test_replicas_above_one_need_a_cluster_not_the_embedded_server(
    tiny_checkpoint: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = str(tiny_checkpoint("llama"))
    with pytest.raises(SystemExit):
        main(["serve", model, "--jetstream-replicas", "3"])
    assert "--jetstream-replicas 3 needs a NATS cluster (--nats-url)" in capsys.readouterr().err
    for options in ({"nats_url": "nats://a:4222"}, {"bus": "memory"}, {}):
        replicas = 1 if not options else 3
        check_embedded_server(
            ShoalConfig.from_options(model=model, jetstream_replicas=replicas, **options)
        )


def test_the_object_tier_is_planned_with_the_replicas() -> None:
    extra = {"cpu_bytes_to_use": 4000, "secondary_tiers": [{"type": "obj", "bytes_to_use": 2000}]}
    kv = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    config = ShoalConfig.from_options(
        model="m",
        kv_transfer_config={**kv, "kv_connector_extra_config": extra},
        jetstream_replicas=3,
    )
    (obj_plan,) = [p for p in plan_tiers(config) if "tier_config" in p.kwargs]
    assert obj_plan.kwargs["jetstream_replicas"] == 3


async def test_the_ports_board_opens_its_bucket_with_the_replicas() -> None:
    opened: list[dict[str, object]] = []

    class FakeBucket:
        async def put(self, key: str, value: bytes) -> None:
            pass

    class FakeBus:
        async def open_kv(self, name: str, **options: object) -> FakeBucket:
            opened.append({"name": name, **options})
            return FakeBucket()

    board = port_board_for(cast(Bus, FakeBus()), Subjects("ns"), replicas=3)
    await board.put("k", "tcp://h:1")
    assert opened == [
        {
            "name": Subjects("ns").group_ports_bucket(),
            "ttl_s": group_ports.PORTS_TTL_S,
            "replicas": 3,
        }
    ]
