"""The disaggregated prefill group (``config.disaggregation``): roles, local mode's plan of
prefill and decode engine cores, vLLM's ``--kv-transfer-config`` spelling, and clear errors."""

from __future__ import annotations

import pytest

from shoal.config.deployment import ShoalConfig
from shoal.deploy.deployment import plan_actors


def test_local_mode_plans_prefill_then_decode_engine_cores() -> None:
    config = ShoalConfig.from_options(model="m", num_prefill=2, num_decode=1)
    assert config.parallel_config.data_parallel_size == 3
    disagg = config.disaggregation_config
    assert disagg.enabled and [disagg.role_of(d) for d in range(3)] == [
        "prefill",
        "prefill",
        "decode",
    ]
    engines = [p for p in plan_actors(config) if p.kind == "engine"]
    assert [p.kwargs["dp_rank"] for p in engines] == [0, 1, 2]


def test_one_engine_cores_role_and_the_default() -> None:
    assert not ShoalConfig.from_options(model="m").disaggregation_config.enabled
    config = ShoalConfig.from_options(model="m", disagg_role="decode")
    assert config.disaggregation_config.enabled
    assert config.disaggregation_config.role_of(5) == "decode"


@pytest.mark.parametrize(
    ("role", "expected"),
    [("kv_producer", "prefill"), ("kv_consumer", "decode"), ("kv_both", "both")],
)
def test_vllms_kv_transfer_config_spelling(role: str, expected: str) -> None:
    config = ShoalConfig.from_options(
        model="m", kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": role}
    )
    assert config.disaggregation_config.disagg_role == expected
    assert not config.kv_transfer_config.enabled  # (no KV offload)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"disagg_role": "producer"}, "disagg_role must be one of both, prefill, decode"),
        ({"num_prefill": 1}, "num_prefill and num_decode go together"),
        ({"num_prefill": 1, "num_decode": 1, "data_parallel_size": 3}, "must equal"),
        ({"max_prefill_queue_size": -1}, "max_prefill_queue_size must be >= 0"),
        ({"kv_handover_lease_s": 0}, "kv_handover_lease_s must be positive"),
        (
            {"kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_lender"}},
            "kv_role must be one of",
        ),
        (
            {
                "kv_transfer_config": {
                    "kv_connector": "NixlConnector",
                    "kv_connector_extra_config": {"backends": ["UCX"]},
                }
            },
            "is not supported with 'NixlConnector'",
        ),
        ({"kv_transfer_config": {"kv_connector": "P2pNcclConnector"}}, "is not supported"),
    ],
)
def test_bad_values_are_refused_naming_the_option(options: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=message):
        ShoalConfig.from_options(model="m", **options)
