"""The bus on a three-node NATS cluster (``nats_cluster``): messages cross nodes, a client given
one node's URL moves to a node it was never given when its node dies (the cluster's advertised
URLs), ``on_reconnect`` listeners hear of it, and JetStream KV / Object Store buckets with three
replicas keep their data and take writes with their leader's node gone."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from shoal.bus import connect_bus
from shoal.bus.base import Bus
from shoal.bus.errors import BusError
from shoal.bus.msg import Msg
from shoal.bus.nats_ops.cluster import (
    NatsCluster,
    cluster_block,
    free_ports,
    healthz,
    route_auth,
)
from shoal.bus.nats_ops.credentials import redact_url
from shoal.bus.transport.nats_bus import NatsBus

pytestmark = [pytest.mark.nats, pytest.mark.slow, pytest.mark.timeout(120)]

HUNG_NODE_S = 8.0  # pings every 1 s, 2 may go unanswered: ~3 s
FAILOVER_S = 30.0  # JetStream elects new stream leaders within seconds; bounded generously


async def _node_bus(cluster: NatsCluster, index: int) -> NatsBus:
    bus = NatsBus([cluster.urls[index]], name=f"client-{index}")
    await bus.connect()
    assert bus.connected_url == cluster.urls[index]
    return bus


async def _echo_across(sender: Bus, receiver: Bus, subject: str) -> bytes:
    async def echo(msg: Msg) -> None:
        await msg.respond(b"echo:" + msg.data)

    sub = await receiver.subscribe(subject, echo)
    await receiver.flush()
    try:
        return (await _request_until_answered(sender, subject, b"hi")).data
    finally:
        await sub.unsubscribe()


async def _request_until_answered(bus: Bus, subject: str, data: bytes) -> Msg:
    """A subscription made on one node reaches the others' interest graph shortly after."""
    async with asyncio.timeout(FAILOVER_S):
        while True:
            try:
                return await bus.request(subject, data, timeout=1.0)
            except BusError:
                await asyncio.sleep(0.05)  # paces the retries


async def _until_ok(make_call, what: str):  # type: ignore[no-untyped-def]
    """Retry a JetStream call while the cluster elects a new leader (bounded)."""
    async with asyncio.timeout(FAILOVER_S):
        while True:
            try:
                return await make_call()
            except Exception:  # the client's timeouts and "no leader" errors during the election
                await asyncio.sleep(0.1)  # paces the retries


def test_cluster_nodes_share_a_meta_leader(nats_cluster: NatsCluster):
    assert len(set(nats_cluster.urls)) == 3
    assert nats_cluster.url == ",".join(nats_cluster.urls)
    for node in nats_cluster.nodes:
        assert node.monitor_port is not None and healthz(node.monitor_port) == "ok"


def test_a_cluster_s_ports_are_all_distinct_and_picked_before_start():
    """A node left to pick its own client port could be handed another's cluster port."""
    cluster = NatsCluster(3)
    try:
        ports = [node.port for node in cluster.nodes] + cluster.cluster_ports
        ports += cluster.monitor_ports
        assert None not in ports and len(set(ports)) == 9
        assert len(set(free_ports(64))) == 64
    finally:
        cluster.cleanup()


def test_cluster_block_routes_every_node_with_the_route_credentials():
    block = cluster_block("c", "0.0.0.0:6222", route_auth(["a:6222", "b:6222"], "u", "pw"))
    assert '"c"' in block and 'authorization { user: "u", password: "pw" }' in block
    assert "nats-route://u:pw@a:6222" in block and "nats-route://u:pw@b:6222" in block
    assert "nats-route://a:6222" in route_auth(["a:6222"]) and "authorization" not in block[:20]
    assert "nats-route://u:p%40ss%3Aw@a:6222" in route_auth(["a:6222"], "u", "p@ss:w")
    with pytest.raises(ValueError, match="both"):
        route_auth(["a:6222"], "u")


def test_urls_are_logged_without_credentials():
    assert redact_url("nats://user:secret@host:4222") == "nats://user:***@host:4222"
    assert redact_url("tls://host:4222") == "tls://host:4222"
    assert "secret" not in redact_url("nats://a:4222,nats://u:secret@b:4222")


async def test_a_message_crosses_nodes(nats_cluster: NatsCluster):
    buses = [await _node_bus(nats_cluster, i) for i in range(3)]
    try:
        assert await _echo_across(buses[0], buses[2], "x.cross") == b"echo:hi"
        assert await _echo_across(buses[2], buses[1], "x.cross2") == b"echo:hi"
    finally:
        for bus in buses:
            await bus.close()


async def test_a_client_moves_to_a_node_it_was_not_given(nats_cluster: NatsCluster):
    """Given node 0 only, the client learns the others from the cluster and, node 0 killed,
    reconnects to one of them; its subscription follows and its listener is told."""
    moving = await _node_bus(nats_cluster, 0)
    other = await _node_bus(nats_cluster, 2)
    heard: list[int] = []
    moving.on_reconnect(lambda: heard.append(1))

    async def echo(msg: Msg) -> None:
        await msg.respond(msg.data)

    await moving.subscribe("x.moving", echo)
    await moving.flush()
    try:
        nats_cluster.kill_node(0)
        async with asyncio.timeout(FAILOVER_S):
            while not moving.is_connected or not heard:
                await asyncio.sleep(0.02)  # paces the polling
        assert moving.connected_url in nats_cluster.urls[1:]
        assert (await _request_until_answered(other, "x.moving", b"ping")).data == b"ping"
    finally:
        await moving.close()
        await other.close()


async def test_a_client_leaves_a_node_that_hangs_without_closing_its_sockets(
    nats_cluster: NatsCluster,
):
    """Node 0 frozen (SIGSTOP: its sockets stay open, as when a host vanishes): the client's
    unanswered pings give it up within ``HUNG_NODE_S`` (below an engine core's 5 s
    worker_dead_after_s plus a margin), and it moves to another node."""
    moving = await _node_bus(nats_cluster, 0)
    heard: list[int] = []
    moving.on_reconnect(lambda: heard.append(1))
    pid = nats_cluster.nodes[0].pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        async with asyncio.timeout(HUNG_NODE_S):
            while not heard:
                await asyncio.sleep(0.02)  # paces the polling
        assert moving.connected_url in nats_cluster.urls[1:]
    finally:
        os.kill(pid, signal.SIGCONT)
        await moving.close()


async def test_replicated_buckets_survive_a_node(nats_cluster: NatsCluster):
    """With three replicas, a KV bucket and an Object Store keep what they hold and take new
    writes when the KV bucket's leader node dies."""
    bus = await connect_bus(nats_cluster.url)
    assert isinstance(bus, NatsBus)
    try:
        kv = await bus.open_kv("test_cluster_kv", replicas=3)
        objects = await bus.open_object_store("test_cluster_obj", replicas=3)
        await kv.put("key", b"before")
        await objects.put("blob", b"x" * 300_000)
        info = await bus.client.jetstream().stream_info("KV_test_cluster_kv")
        assert info.cluster is not None and len(info.cluster.replicas or []) == 2
        victim = nats_cluster.server_names.index(info.cluster.leader)
        nats_cluster.kill_node(victim)  # the bucket's leader
        assert await _until_ok(lambda: kv.get("key"), "kv get") == b"before"
        await _until_ok(lambda: kv.put("key", b"after"), "kv put")
        assert await _until_ok(lambda: kv.get("key"), "kv get") == b"after"
        assert await _until_ok(lambda: objects.get("blob"), "obj get") == b"x" * 300_000
        assert await _until_ok(lambda: objects.put("blob2", b"y" * 1000), "obj put")
        await objects.close()
    finally:
        await bus.close()
