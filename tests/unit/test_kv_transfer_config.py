"""KV offload configuration in vLLM's spelling: ``--kv-transfer-config`` JSON (and the same dict
to ``ShoalConfig.from_options`` / ``LLM``) and the ``--kv-offloading-size`` shortcut become the
flat ``KVTransferConfig`` group; bad keys are named; the group survives ``to_options``,
``replace`` and the JSON an actor process is started with."""

from __future__ import annotations

import argparse
import json
from typing import Any, ClassVar

import msgspec
import pytest

from shoal.bus.runtime.actor import Actor
from shoal.bus.runtime.run_actor import build_actor
from shoal.bus.runtime.supervisor import ActorSpec
from shoal.bus.transport.memory import InMemoryBus
from shoal.config.deployment import ShoalConfig
from shoal.config.kv_transfer import (
    FsTierConfig,
    KVTransferConfig,
    ObjTierConfig,
    P2PTierConfig,
)
from shoal.deploy.arguments import add_engine_arguments, config_from_namespace
from shoal.deploy.cli import build_parser
from shoal.deploy.deployment import (
    CPU_TIER_TARGET,
    FS_TIER_TARGET,
    OBJ_TIER_TARGET,
    P2P_TIER_TARGET,
    build_config,
    plan_actors,
    plan_tiers,
)

GIB = 1 << 30
FULL = {
    "kv_connector": "OffloadingConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 3 * GIB,
        "eviction_policy": "arc",
        "block_size": 64,
        "store_threshold": 2,
        "max_tracker_size": 500,
        "offload_prompt_only": False,
        "secondary_tiers": [
            {"type": "fs", "path": "/mnt/a", "bytes_to_use": 1000},
            {"type": "fs", "root_dir": "/mnt/b"},  # vLLM's name for the path
            {"type": "obj", "bytes_to_use": 2000},
            {"type": "p2p", "transfer_window": 8, "peer_lookup_timeout_s": 0.05},
        ],
        "cpu_tier_id": "kv-host",
        "kv_lookup_timeout_s": 0.5,
        "max_pending_store_chunks": 8,
        "offload_policy": "request_level",
        "canonical_layout": True,
    },
}
EXPECTED = KVTransferConfig(
    kv_connector="OffloadingConnector",
    cpu_bytes_to_use=3 * GIB,
    eviction_policy="arc",
    blocks_per_chunk=4,  # 64 tokens of 16-token blocks
    store_threshold=2,
    max_tracker_size=500,
    offload_prompt_only=False,
    secondary_tiers=(
        FsTierConfig(path="/mnt/a", bytes_to_use=1000),
        FsTierConfig(path="/mnt/b"),
        ObjTierConfig(bytes_to_use=2000),
        P2PTierConfig(transfer_window=8, peer_lookup_timeout_s=0.05),
    ),
    cpu_tier_id="kv-host",
    kv_lookup_timeout_s=0.5,
    max_pending_store_chunks=8,
    offload_policy="request_level",
    canonical_layout=True,
)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(list(argv))


def _extra(**extra: Any) -> dict[str, Any]:
    """A kv_transfer_config whose extra config is ``cpu_bytes_to_use=1 GiB`` plus ``extra``."""
    config = {"cpu_bytes_to_use": GIB, **extra}
    return {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": config}


def test_offload_is_off_without_its_flags(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = config_from_namespace(_parse(), str(tmp_path))
    assert config.kv_transfer_config == KVTransferConfig()
    assert not config.kv_transfer_config.enabled


def test_the_cli_json_sets_every_field_of_the_group(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ns = _parse("--kv-transfer-config", json.dumps(FULL))
    assert config_from_namespace(ns, str(tmp_path)).kv_transfer_config == EXPECTED


def test_the_same_dict_works_offline_and_through_llms_builder(tmp_path) -> None:  # type: ignore[no-untyped-def]
    offline = ShoalConfig.from_options(model="m", kv_transfer_config=FULL)
    assert offline.kv_transfer_config == EXPECTED
    # LLM(model, **options) builds its config with build_config.
    llm = build_config(model=str(tmp_path), bus="memory", kv_transfer_config=FULL)
    assert llm.kv_transfer_config == EXPECTED


def test_chunk_tokens_become_blocks_of_the_configured_cache_block_size(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ns = _parse("--block-size", "32", "--kv-transfer-config", json.dumps(_extra(block_size=128)))
    assert config_from_namespace(ns, str(tmp_path)).kv_transfer_config.blocks_per_chunk == 4
    config = ShoalConfig.from_options(
        model="m", block_size=8, kv_transfer_config=_extra(block_size=8)
    )
    assert config.kv_transfer_config.blocks_per_chunk == 1
    direct = ShoalConfig.from_options(model="m", kv_transfer_config=_extra(blocks_per_chunk=3))
    assert direct.kv_transfer_config.blocks_per_chunk == 3


def test_kv_role_defaults_to_both_and_missing_extra_config_still_needs_the_bytes() -> None:
    config = ShoalConfig.from_options(model="m", kv_transfer_config=_extra())
    assert config.kv_transfer_config.kv_role == "kv_both"
    with pytest.raises(ValueError, match=r"extra_config\.cpu_bytes_to_use is required"):
        ShoalConfig.from_options(
            model="m", kv_transfer_config={"kv_connector": "OffloadingConnector"}
        )


@pytest.mark.parametrize(
    ("kv_transfer_config", "problem"),
    [
        (_extra(canonical_layout="yes"), r"`bool`.*`kv_connector_extra_config\.canonical_layout`"),
        (_extra(cache_policy_module_path="x"), "cache_policy_module_path is not supported"),
        (_extra(tier_poll_interval_s=0.01), "tier_poll_interval_s is not supported"),
        (_extra(sync_load_budget_bytes=1), "sync_load_budget_bytes is not supported"),
        (_extra(backpressure={"high": 1}), "unknown field `high` - at `kv_connector_extra_config"),
        (_extra(self_describing_kv_events=True), "self_describing_kv_events is not supported"),
        (_extra(spec_module_path="m"), "spec_module_path is not supported"),
        (_extra(spec_name="MyOwnSpec"), r"spec_name 'MyOwnSpec' is not supported"),
        (_extra(num_cpu_blocks=9), "extra_config.num_cpu_blocks is an unknown key"),
        ({**_extra(), "kv_buffer_device": "cuda"}, "kv_buffer_device is not supported"),
        ({**_extra(), "cpu_bytes_to_use": 1}, "kv_transfer_config.cpu_bytes_to_use is an unknown"),
        ({"kv_connector": "LMCacheConnectorV1"}, r"kv_connector 'LMCacheConnectorV1' is not supp"),
        ({"kv_role": "kv_both"}, "kv_transfer_config.kv_connector is required"),
        ({**_extra(), "kv_role": "kv_producer"}, "kv_role must be one of kv_both"),
        (
            {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {}},
            "cpu_bytes_to_use is required",
        ),
        (_extra(block_size=64, blocks_per_chunk=4), "block_size and blocks_per_chunk are mutually"),
        (_extra(block_size=24), r"block_size must be a positive multiple of .*\(16\), got 24"),
        (_extra(eviction_policy="lfu"), "eviction_policy must be one of lru, arc"),
        (_extra(store_threshold=-1), "store_threshold must be non-negative"),
        (_extra(cpu_bytes_to_use="lots"), r"Expected `int`.*extra_config.cpu_bytes_to_use"),
        (_extra(secondary_tiers=[{"type": "kvcr"}]), r"secondary_tiers\[0\].type 'kvcr' is not"),
        (
            _extra(secondary_tiers=[{"type": "p2p", "port": 5710}]),
            r"secondary_tiers\[0\].port is not supported",
        ),
        (
            _extra(secondary_tiers=[{"type": "p2p", "bytes_to_use": 1}]),
            r"secondary_tiers\[0\].bytes_to_use is an unknown key",
        ),
        (
            _extra(secondary_tiers=[{"type": "p2p", "transfer_window": 0}]),
            r"secondary_tiers\[\]?.transfer_window must be a positive",
        ),
        (
            _extra(secondary_tiers=[{"type": "p2p", "peer_lookup_timeout_s": 0}]),
            r"peer_lookup_timeout_s must be positive",
        ),
        (
            _extra(secondary_tiers=[{"type": "p2p"}, {"type": "p2p"}]),
            "secondary_tiers may hold one p2p tier",
        ),
        (
            _extra(kv_lookup_timeout_s=1.0, secondary_tiers=[{"type": "p2p"}]),
            r"peer_lookup_timeout_s must be at most kv_lookup_timeout_s / 8 \(0.125 s\)",
        ),
        (
            _extra(secondary_tiers=[{"type": "p2p", "data_port": 70000}]),
            r"data_port must be a TCP port",
        ),
        (
            _extra(secondary_tiers=[{"type": "obj", "access_key": "k"}]),
            r"secondary_tiers\[0\].access_key is not supported",
        ),
        (
            _extra(secondary_tiers=[{"type": "obj", "path": "/x"}]),
            r"secondary_tiers\[0\].path is an unknown key",
        ),
        (
            _extra(secondary_tiers=[{"type": "obj", "bucket": "a.b"}]),
            r"secondary_tiers\[\]?.bucket must be letters",
        ),
        (_extra(secondary_tiers=[{"type": "obj", "bytes_to_use": 0}]), "bytes_to_use must be"),
        (_extra(secondary_tiers=[{"path": "/x"}]), r"secondary_tiers\[0\].type is required"),
        (_extra(secondary_tiers=[{"type": "fs"}]), r"missing required field `path`.*tiers\[0\]"),
        (
            _extra(secondary_tiers=[{"type": "fs", "path": "/x"}, {"type": "fs", "size": 1}]),
            r"secondary_tiers\[1\].size is an unknown key",
        ),
        (
            _extra(secondary_tiers=[{"type": "fs", "path": "/x", "n_read_threads": 4}]),
            r"secondary_tiers\[0\].n_read_threads is not supported",
        ),
        (
            _extra(secondary_tiers=[{"type": "fs", "path": "/x", "root_dir": "/y"}]),
            r"root_dir and path name the same",
        ),
        (_extra(secondary_tiers={"type": "fs"}), "secondary_tiers must be a JSON list"),
        ({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": 5}, "JSON object"),
    ],
)
def test_bad_configs_name_the_key(kv_transfer_config: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        ShoalConfig.from_options(model="m", kv_transfer_config=kv_transfer_config)


def test_cli_errors_name_the_key(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ns = _parse("--kv-transfer-config", json.dumps(_extra(backpressure={"high": 1})))
    with pytest.raises(ValueError, match=r"at `kv_connector_extra_config\.backpressure`"):
        config_from_namespace(ns, str(tmp_path))
    with pytest.raises(SystemExit):  # not a JSON object
        _parse("--kv-transfer-config", "[1]")


def test_the_offloading_size_shortcut(tmp_path) -> None:  # type: ignore[no-untyped-def]
    expected = KVTransferConfig(kv_connector="OffloadingConnector", cpu_bytes_to_use=GIB * 3 // 2)
    ns = _parse("--kv-offloading-size", "1.5", "--kv-offloading-backend", "native")
    assert config_from_namespace(ns, str(tmp_path)).kv_transfer_config == expected
    offline = ShoalConfig.from_options(model="m", kv_offloading_size=1.5)
    assert offline.kv_transfer_config == expected
    for bad in ("0", "-1", "lots"):
        with pytest.raises(SystemExit):
            _parse("--kv-offloading-size", bad)
    with pytest.raises(ValueError, match="kv_offloading_size must be a positive"):
        ShoalConfig.from_options(model="m", kv_offloading_size=0)


def test_the_shortcut_and_the_json_conflict_and_only_native_is_a_backend() -> None:
    with pytest.raises(SystemExit):  # argparse: not allowed together
        _parse("--kv-offloading-size", "1", "--kv-transfer-config", json.dumps(_extra()))
    with pytest.raises(ValueError, match="kv_offloading_size conflicts with kv_transfer_config"):
        ShoalConfig.from_options(model="m", kv_offloading_size=1, kv_transfer_config=_extra())
    with pytest.raises(ValueError, match="kv_offloading_backend 'lmcache' is not supported"):
        ShoalConfig.from_options(model="m", kv_offloading_size=1, kv_offloading_backend="lmcache")
    with pytest.raises(SystemExit):
        _parse("--kv-offloading-backend", "lmcache")


def test_options_replace_and_json_keep_the_group() -> None:
    config = ShoalConfig.from_options(model="m", kv_transfer_config=FULL)
    assert ShoalConfig.from_options(**config.to_options()) == config
    assert msgspec.json.decode(msgspec.json.encode(config), type=ShoalConfig) == config
    assert config.replace(bus="memory").kv_transfer_config == EXPECTED
    # A group's JSON (or the shortcut) given to replace replaces the whole group.
    resized = config.replace(kv_offloading_size=2)
    assert resized.kv_transfer_config == KVTransferConfig(
        kv_connector="OffloadingConnector", cpu_bytes_to_use=2 * GIB
    )
    assert config.replace(kv_transfer_config=_extra()).kv_transfer_config.secondary_tiers == ()
    assert config.replace(kv_transfer_config=None).kv_transfer_config == KVTransferConfig()
    # A flat option beside the JSON wins over it.
    both = ShoalConfig.from_options(model="m", kv_transfer_config=FULL, kv_lookup_timeout_s=3.0)
    assert both.kv_transfer_config.kv_lookup_timeout_s == 3.0


class _ConfigProbe(Actor):
    kind: ClassVar[str] = "probe"

    def __init__(self, bus: Any, actor_id: str, *, config: ShoalConfig) -> None:
        super().__init__(bus, actor_id)
        self.config = config


def test_an_actor_process_gets_the_offload_config_back_whole() -> None:
    config = ShoalConfig.from_options(model="m", kv_transfer_config=FULL)
    plan = next(p for p in plan_actors(config) if p.kind == "worker")
    assert plan.kwargs["config"] == config
    # What the supervisor puts on the child's command line, read back as run_actor does.
    command = ActorSpec("p", "x:Y", "nats://h:1", {"actor_id": "p", "config": config}).command()
    kwargs = json.loads(command[command.index("--kwargs") + 1])
    actor = build_actor(_ConfigProbe, InMemoryBus(), kwargs)
    assert isinstance(actor, _ConfigProbe)
    assert actor.config == config
    assert actor.config.kv_transfer_config.secondary_tiers == EXPECTED.secondary_tiers


def test_each_secondary_tier_gets_its_actor_before_the_cpu_tier() -> None:
    config = ShoalConfig.from_options(model="m", kv_transfer_config=FULL)
    plans = plan_tiers(config)
    assert [(p.name, p.target) for p in plans] == [
        ("kv-host-fs0", FS_TIER_TARGET),
        ("kv-host-fs1", FS_TIER_TARGET),
        ("kv-host-obj2", OBJ_TIER_TARGET),
        ("kv-host-p2p3", P2P_TIER_TARGET),
        ("kv-host", CPU_TIER_TARGET),
    ]
    assert plans[2].kwargs["tier_config"] == ObjTierConfig(bytes_to_use=2000)
    assert "cpu_tier_id" not in plans[2].kwargs
    # the obj tier's probe fits the CPU tier's wait for one secondary (kv_lookup_timeout_s / 4)
    assert plans[2].kwargs["probe_timeout_s"] == config.kv_transfer_config.kv_lookup_timeout_s / 8
    assert all("probe_timeout_s" not in plans[i].kwargs for i in (0, 1, 3, 4))
    assert plans[3].kwargs["cpu_tier_id"] == "kv-host"  # the CPU tier it serves peers from


def test_serve_and_actor_take_the_flags(tmp_path) -> None:  # type: ignore[no-untyped-def]
    parser = build_parser()
    for command in (["serve", str(tmp_path)], ["actor", "worker", str(tmp_path)]):
        ns = parser.parse_args([*command, "--kv-transfer-config", json.dumps(FULL)])
        assert config_from_namespace(ns, str(tmp_path)).kv_transfer_config == EXPECTED
        ns = parser.parse_args([*command, "--kv-offloading-size", "2"])
        assert config_from_namespace(ns, str(tmp_path)).kv_transfer_config.cpu_bytes_to_use == (
            2 * GIB
        )


def test_offload_without_prefix_caching_is_refused_naming_both() -> None:
    with pytest.raises(ValueError, match=r"kv_transfer_config.*enable_prefix_caching"):
        ShoalConfig.from_options(model="m", enable_prefix_caching=False, kv_offloading_size=1)


def test_the_help_example_parses_with_every_tier_type() -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a.choices, dict))
    serve = commands.choices["serve"]
    text = next(a.help for a in serve._actions if a.dest == "kv_transfer_config")
    assert text is not None
    example = json.loads(text[text.index("'{") + 1 : text.rindex("}'") + 1])
    tiers = ShoalConfig.from_options(model="m", kv_transfer_config=example).kv_transfer_config
    assert [t.type for t in tiers.secondary_tiers] == ["fs", "obj", "p2p"]
    assert tiers.canonical_layout
