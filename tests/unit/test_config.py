"""One configuration document from the command line (or ``LLM(...)``) to every actor: flat
options find their group by name, the document survives JSON whole, invalid values name the
option, and an actor process gets it back typed."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import pytest
import torch

from shoal.bus.runtime.actor import Actor
from shoal.bus.runtime.run_actor import build_actor
from shoal.bus.transport.memory import InMemoryBus
from shoal.config.deployment import (
    GROUPS,
    OPTION_GROUPS,
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    ShoalConfig,
)
from shoal.deploy.arguments import KV_OFFLOAD_FLAGS, add_engine_arguments, config_from_namespace
from shoal.deploy.deployment import build_config
from shoal.deploy.model_files import load_chat_template
from shoal.workers.config import resolve_dtype
from shoal.workers.cpu_info import AUTO_DTYPE_ENV, BF16_FLAGS, auto_cpu_dtype, cpu_flags


def test_option_names_are_unique_across_groups() -> None:
    names = [name for struct in GROUPS.values() for name in struct.__struct_fields__]
    assert len(names) == len(set(names)) == len(OPTION_GROUPS)


def test_flat_options_land_in_their_groups() -> None:
    config = ShoalConfig.from_options(
        model="m",
        max_num_seqs=7,
        block_size=32,
        tensor_parallel_size=2,
        namespace="ns",
        scheduling_policy="priority",
    )
    assert config.model_config == ModelConfig(model="m")
    assert config.scheduler_config.max_num_seqs == 7
    assert config.scheduler_config.scheduling_policy == "priority"
    assert config.cache_config.block_size == 32
    assert config.parallel_config.tensor_parallel_size == 2
    assert config.bus_config.namespace == "ns"


def test_an_unknown_option_is_named_with_the_known_ones() -> None:
    with pytest.raises(
        ValueError, match=r"unknown engine option 'max_num_sequences'.*max_num_seqs"
    ):
        ShoalConfig.from_options(model="m", max_num_sequences=7)


def test_options_and_json_round_trip() -> None:
    config = ShoalConfig.from_options(model="m", dtype="bfloat16", watermark=0.1, bus="memory")
    assert ShoalConfig.from_options(**config.to_options()) == config
    assert msgspec.json.decode(msgspec.json.encode(config), type=ShoalConfig) == config
    assert config.replace(max_num_seqs=3).scheduler_config.max_num_seqs == 3
    assert config.replace(max_num_seqs=3).model_config == config.model_config


@pytest.mark.parametrize(
    ("options", "option"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"dtype": "float8"}, "dtype"),
        ({"block_size": 12}, "block_size"),
        ({"bus": "pigeon"}, "bus"),
        ({"bus": "memory", "tensor_parallel_size": 2}, "NATS bus"),
        ({"step_timeout_s": 0}, "step_timeout_s"),
        ({"enable_dbo": True}, "needs enable_expert_parallel"),
        ({"enable_expert_parallel": True, "tensor_parallel_size": 2}, "enable_expert_parallel"),
        ({"enable_expert_parallel": True, "data_parallel_size": 2, "bus": "memory"}, "NATS"),
        ({"dbo_decode_token_threshold": 1}, "dbo_decode_token_threshold"),
        ({"dbo_prefill_token_threshold": 0}, "dbo_prefill_token_threshold"),
        ({"quantization": "fp8"}, "quantization must be one of int8, int4"),
        ({"quantization": "int4", "device": "cuda"}, "quantization int4 runs torch's CPU"),
    ],
)
def test_invalid_values_name_the_option_when_built_and_when_decoded(options, option) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=option):
        ShoalConfig.from_options(model="m", **options)
    document = msgspec.json.encode(ShoalConfig.from_options(model="m")).decode()
    bad = msgspec.json.decode(document)
    for name, value in options.items():
        bad[OPTION_GROUPS[name]][name] = value
    with pytest.raises(msgspec.ValidationError, match=option):
        msgspec.json.decode(msgspec.json.encode(bad), type=ShoalConfig)


def test_auto_dtype_follows_the_device_and_the_cpu(monkeypatch) -> None:
    monkeypatch.delenv(AUTO_DTYPE_ENV, raising=False)
    assert resolve_dtype("auto", "cuda:1") == torch.bfloat16
    assert resolve_dtype("float16", "cuda") == torch.float16
    assert resolve_dtype("float32", "cpu") == torch.float32
    assert auto_cpu_dtype(frozenset({"avx2", "fma"})) == "float32"
    assert auto_cpu_dtype(frozenset({"avx2", "avx512f", "avx512_bf16"})) == "bfloat16"
    assert auto_cpu_dtype(frozenset({"avx512f", "amx_tile", "amx_bf16"})) == "bfloat16"
    expected = torch.bfloat16 if BF16_FLAGS & cpu_flags() else torch.float32
    assert resolve_dtype("auto", "cpu") == expected
    monkeypatch.setenv(AUTO_DTYPE_ENV, "float32")
    assert auto_cpu_dtype(frozenset({"amx_bf16"})) == "float32"
    assert resolve_dtype("auto", "cpu") == torch.float32


def test_config_defaults_follow_vllm() -> None:
    scheduler = SchedulerConfig()
    assert (scheduler.max_num_batched_tokens, scheduler.max_num_seqs) == (2048, 128)
    assert scheduler.enable_chunked_prefill and scheduler.scheduling_policy == "fcfs"
    assert scheduler.long_prefill_token_threshold == 0 and scheduler.token_budget == 2048
    cache = CacheConfig()
    assert (cache.block_size, cache.enable_prefix_caching) == (16, True)
    assert cache.prefix_caching_hash_algo == "sha256"


@pytest.mark.parametrize(
    ("config", "kwargs", "field"),
    [
        (SchedulerConfig, {"max_num_seqs": 0}, "max_num_seqs"),
        (SchedulerConfig, {"scheduling_policy": "lifo"}, "scheduling_policy"),
        (SchedulerConfig, {"watermark": 1.0}, "watermark"),
        (SchedulerConfig, {"max_num_scheduled_tokens": 4096}, "max_num_scheduled_tokens"),
        (CacheConfig, {"block_size": 12}, "block_size"),
        (CacheConfig, {"prefix_caching_hash_algo": "md5"}, "prefix_caching_hash_algo"),
        (CacheConfig, {"num_gpu_blocks_override": 1}, "num_gpu_blocks_override"),
    ],
)
def test_invalid_config_names_the_field(config: type, kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        config(**kwargs)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_flags_are_config_options_with_the_configs_defaults(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ns = _parse()
    # The JSON of a group, and the KV offload shortcut.
    assert set(vars(ns)) <= {
        *OPTION_GROUPS,
        "fault_tolerance_config",
        *KV_OFFLOAD_FLAGS,
        "speculative_config",
    }
    assert config_from_namespace(ns, str(tmp_path)) == ShoalConfig.from_options(model=str(tmp_path))


def test_fault_tolerance_is_on_by_default_and_the_flag_turns_it_off(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """shoal's one default that differs from vLLM's (docs/fault-tolerance.md)."""
    ft = config_from_namespace(_parse(), str(tmp_path)).fault_tolerance_config
    assert ft.enable_fault_tolerance and ft.enable_recovery_controller
    assert ft.enable_request_resumption
    assert ft.engine_recovery_timeout_sec == 120  # vLLM's default
    assert ShoalConfig.from_options(
        model=str(tmp_path)
    ).fault_tolerance_config.enable_fault_tolerance
    off = config_from_namespace(_parse("--no-enable-fault-tolerance"), str(tmp_path))
    assert not off.fault_tolerance_config.enable_fault_tolerance
    json_off = _parse("--fault-tolerance-config", '{"enable_fault_tolerance": false}')
    assert not config_from_namespace(
        json_off, str(tmp_path)
    ).fault_tolerance_config.enable_fault_tolerance
    both = _parse(
        "--no-enable-fault-tolerance", "--fault-tolerance-config", '{"max_request_resumptions": 1}'
    )
    assert not config_from_namespace(
        both, str(tmp_path)
    ).fault_tolerance_config.enable_fault_tolerance


def test_fault_tolerance_config_json_turns_it_on_and_sets_its_fields(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ns = _parse(
        "--fault-tolerance-config",
        '{"engine_recovery_timeout_sec": 7, "max_request_resumptions": 0}',
    )
    ft = config_from_namespace(ns, str(tmp_path)).fault_tolerance_config
    assert (
        ft.enable_fault_tolerance,
        ft.engine_recovery_timeout_sec,
        ft.max_request_resumptions,
    ) == (True, 7, 0)
    offline = ShoalConfig.from_options(
        model=str(tmp_path), fault_tolerance_config={"recovery_max_retries": 2}
    )
    assert offline.fault_tolerance_config.enable_fault_tolerance
    assert offline.fault_tolerance_config.recovery_max_retries == 2
    assert msgspec.json.decode(msgspec.json.encode(offline), type=ShoalConfig) == offline


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"engine_recovery_timeout_sec": 0}', "engine_recovery_timeout_sec must be a positive"),
        ('{"no_such_field": 1}', "unknown fields: no_such_field"),
        ('{"recovery_backoff_s": -1}', "recovery_backoff_s must be positive"),
    ],
)
def test_fault_tolerance_config_errors_name_the_field(tmp_path, text: str, problem: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=problem):
        config_from_namespace(_parse("--fault-tolerance-config", text), str(tmp_path))


def test_fault_tolerance_config_flag_refuses_what_is_not_a_json_object() -> None:
    with pytest.raises(SystemExit):
        _parse("--fault-tolerance-config", "[1, 2]")


def test_cli_flags_reach_their_options(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ns = _parse(
        "--max-num-seqs", "9", "--kv-cache-memory", "1GiB", "--no-enable-prefix-caching",
        "--scheduling-policy", "priority", "-tp", "2", "--namespace", "x",
    )  # fmt: skip
    config = config_from_namespace(ns, str(tmp_path))
    assert config.scheduler_config.max_num_seqs == 9
    assert config.scheduler_config.scheduling_policy == "priority"
    assert config.cache_config.kv_cache_memory_bytes == 1 << 30
    assert config.cache_config.enable_prefix_caching is False
    assert config.parallel_config.tensor_parallel_size == 2
    assert config.bus_config.namespace == "x"


def test_quantization_flags_as_vllm_spells_them_and_the_dequantize_opt_out(tmp_path) -> None:  # type: ignore[no-untyped-def]
    default = config_from_namespace(_parse(), str(tmp_path)).model_config
    assert (default.quantization, default.dequantize) == (None, False)
    model = config_from_namespace(_parse("-q", "int4", "--dequantize"), str(tmp_path)).model_config
    assert (model.quantization, model.dequantize) == ("int4", True)
    assert (
        config_from_namespace(
            _parse("--quantization", "int8"), str(tmp_path)
        ).model_config.quantization
        == "int8"
    )
    with pytest.raises(SystemExit):
        _parse("--quantization", "awq")
    offline = ShoalConfig.from_options(model="m", quantization="int8", dequantize=True)
    assert (offline.model_config.quantization, offline.model_config.dequantize) == ("int8", True)


def test_expert_parallel_and_dbo_flags_follow_vllm(tmp_path) -> None:  # type: ignore[no-untyped-def]
    parallel = config_from_namespace(_parse(), str(tmp_path)).parallel_config
    assert (parallel.enable_expert_parallel, parallel.enable_dbo) == (False, False)
    assert (parallel.dbo_decode_token_threshold, parallel.dbo_prefill_token_threshold) == (32, 512)
    assert parallel.expert_parallel_size == 1 and not parallel.runs_in_lockstep
    ns = _parse(
        "-dp", "2", "--enable-expert-parallel", "--enable-dbo",
        "--dbo-decode-token-threshold", "8", "--dbo-prefill-token-threshold", "64",
    )  # fmt: skip
    parallel = config_from_namespace(ns, str(tmp_path)).parallel_config
    assert (parallel.enable_expert_parallel, parallel.enable_dbo) == (True, True)
    assert (parallel.dbo_decode_token_threshold, parallel.dbo_prefill_token_threshold) == (8, 64)
    assert parallel.expert_parallel_size == 2 and parallel.runs_in_lockstep


def test_cli_refuses_a_missing_model_directory(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="model directory not found"):
        config_from_namespace(_parse(), str(tmp_path / "nothing"))


class _ConfigProbe(Actor):
    kind: ClassVar[str] = "probe"

    def __init__(self, bus: Any, actor_id: str, *, config: ShoalConfig, rank: int = 0) -> None:
        super().__init__(bus, actor_id)
        self.config, self.rank = config, rank


def test_an_actor_process_gets_the_config_back_typed() -> None:
    config = ShoalConfig.from_options(model="m", max_num_seqs=5, namespace="probe")
    as_sent = msgspec.json.decode(msgspec.json.encode({"actor_id": "p", "config": config}))
    actor = build_actor(_ConfigProbe, InMemoryBus(), {**as_sent, "rank": 3})
    assert isinstance(actor, _ConfigProbe)
    assert actor.config == config and actor.rank == 3


def test_tool_calling_flags_as_vllm_spells_them() -> None:
    """``--enable-auto-tool-choice`` needs ``--tool-call-parser``, one of the gateway's."""
    from shoal.config.deployment import TOOL_CALL_PARSERS
    from shoal.gateway.actor import GatewayActor
    from shoal.gateway.tool_parsers import TOOL_CALL_FORMATS

    assert set(TOOL_CALL_PARSERS) == set(TOOL_CALL_FORMATS)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    ns = parser.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"])
    options = {
        k: v for k, v in vars(ns).items() if k in ("enable_auto_tool_choice", "tool_call_parser")
    }
    config = ShoalConfig.from_options(model="/m", **options)
    assert config.model_config.tool_call_parser == "llama3_json"
    actor = GatewayActor(InMemoryBus(), "gateway-0", config=config)
    assert actor._tool_calling().enable_auto_tool_choice  # what the gateway's app gets
    with pytest.raises(ValueError, match="enable_auto_tool_choice"):
        ShoalConfig.from_options(model="/m", enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser"):
        ShoalConfig.from_options(model="/m", tool_call_parser="pythonic")
    with pytest.raises(SystemExit):
        parser.parse_args(["--tool-call-parser", "pythonic"])


def test_chat_template_and_generation_config_flags_as_vllm_spells_them(tmp_path: Path) -> None:
    model = config_from_namespace(_parse(), str(tmp_path)).model_config
    assert model.chat_template is None and model.trust_request_chat_template is False
    assert model.generation_config == "auto"  # vLLM's default
    template = tmp_path / "template.jinja"
    template.write_text("{{ messages }}")
    for value in (str(template), "{{ messages }}"):
        config = config_from_namespace(_parse("--chat-template", value), str(tmp_path))
        assert config.model_config.chat_template == "{{ messages }}"  # the template's text
    offline = build_config(model=str(tmp_path), chat_template=str(template))  # LLM(...)'s way
    assert offline.model_config.chat_template == "{{ messages }}"
    ns = _parse("--trust-request-chat-template", "--generation-config", str(tmp_path))
    model = config_from_namespace(ns, str(tmp_path)).model_config
    assert model.trust_request_chat_template and model.generation_config == str(tmp_path)
    assert config_from_namespace(_parse("--generation-config", "vllm"), str(tmp_path))
    with pytest.raises(ValueError, match="generation_config: directory not found"):
        config_from_namespace(_parse("--generation-config", str(tmp_path / "no")), str(tmp_path))


def test_a_chat_template_value_is_a_file_or_the_template_itself(tmp_path: Path) -> None:
    """vLLM's rule: a value that opens no file is the template, unless it has none of a
    template's characters (then it is a path that failed, named in the error)."""
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert load_chat_template(str(path)) == "{{ messages }}"
    assert load_chat_template("{{ messages }}") == "{{ messages }}"
    assert load_chat_template("line one\nline two") == "line one\nline two"
    for looks_like_a_path in ("t.jinja", str(tmp_path / "nothing"), str(tmp_path)):
        with pytest.raises(ValueError, match=r"looks like a file path, but it failed to be opened"):
            load_chat_template(looks_like_a_path)
