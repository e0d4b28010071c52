"""Speculative decoding's configuration in vLLM's spelling: ``SpeculativeConfig``'s rules, the
``--speculative-config`` JSON on ``shoal serve`` / ``shoal actor`` (an argparse error naming the
key), ``LLM(speculative_config=...)``, and the group travelling whole to every actor."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

import msgspec
import pytest

from shoal.bus.runtime.run_actor import build_actor
from shoal.bus.runtime.supervisor import ActorSpec
from shoal.bus.transport.memory import InMemoryBus
from shoal.config.deployment import ShoalConfig
from shoal.config.speculative import SpeculativeConfig, speculative_options
from shoal.deploy.actors import actor_target
from shoal.deploy.arguments import add_engine_arguments, config_from_namespace
from shoal.deploy.cli import build_parser
from shoal.deploy.deployment import build_config
from shoal.deploy.llm import LLM
from tests.unit.test_kv_transfer_config import _ConfigProbe

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
NGRAM["prompt_lookup_max"] = 3  # vLLM's documented example
DRAFT = {"model": "/path", "num_speculative_tokens": 2}  # vLLM's: the method follows the model
SCHEDULE = {"method": "ngram", "num_speculative_tokens": 3}
SCHEDULE["num_speculative_tokens_per_batch_size"] = [[65, 128, 1], [1, 64, 3], [129, 512, 0]]


def _group(value: dict[str, Any]) -> SpeculativeConfig:
    return ShoalConfig.from_options(model="m", speculative_config=value).speculative_config


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(list(argv))


def test_vllms_examples_become_the_groups_fields() -> None:
    assert _group(NGRAM) == SpeculativeConfig(
        speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
        prompt_lookup_max=3,
    )  # fmt: skip
    draft = _group(DRAFT)
    assert (draft.speculative_method, draft.speculative_model) == ("draft_model", "/path")
    assert (draft.num_speculative_tokens, draft.num_lookahead_slots) == (2, 2)
    assert _group(SCHEDULE).num_speculative_tokens_per_batch_size == (
        (1, 64, 3), (65, 128, 1), (129, 512, 0),
    )  # fmt: skip
    assert not ShoalConfig.from_options(model="m").speculative_config.enabled
    assert not _group({}).enabled


@pytest.mark.parametrize(
    ("low", "high", "expected"),
    [(None, None, (5, 5)), (2, None, (2, 2)), (None, 7, (7, 7)), (1, 4, (1, 4))],
)
def test_ngram_bounds_default_to_5_and_copy_each_other(
    low: int | None, high: int | None, expected: tuple[int, int]
) -> None:
    given = {"prompt_lookup_min": low, "prompt_lookup_max": high}
    group = _group({"method": "ngram", "num_speculative_tokens": 1, **given})
    assert (group.prompt_lookup_min, group.prompt_lookup_max) == expected


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ({"num_speculative_tokens": 3}, r"speculative_config\.method is required"),
        ({"prompt_lookup_min": 2}, r"speculative_config\.method is required"),
        ({"method": "eagle", "num_speculative_tokens": 1}, r"method must be one of ngram, draft"),
        ({"method": 5}, r"Expected `str \| null`, got `int` - at `\$\.method`"),
        ({"method": "ngram"}, r"num_speculative_tokens must be a positive integer, got 0"),
        ({**NGRAM, "num_speculative_tokens": -1}, r"num_speculative_tokens must be a positive"),
        ({**NGRAM, "num_speculative_tokens": True}, r"`int`, got `bool`.*num_speculative_tokens"),
        ({**NGRAM, "prompt_lookup_min": 0}, r"prompt_lookup_min must be >= 1, got 0"),
        ({**NGRAM, "prompt_lookup_max": 0, "prompt_lookup_min": 2}, r"lookup_max must be >= 1"),
        ({**NGRAM, "prompt_lookup_min": 4}, r"lookup_max must be >= prompt_lookup_min \(4\)"),
        ({**NGRAM, "model": "/d"}, r"speculative_config\.model is only used by method draft_model"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, r"\.model is required"),
        ({**NGRAM, "lookahead": 2}, r"speculative_config\.lookahead is an unknown key"),
        ([1, 2], "speculative_config must be a JSON object"),
    ],
)
def test_bad_configs_name_the_key(value: Any, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        _group(value)


@pytest.mark.parametrize(
    ("schedule", "problem"),
    [
        ([], "non-empty"),
        ([[1, 2]], r"length 3.*num_speculative_tokens_per_batch_size\[0\]"),
        ([[0, 4, 1]], "bounds must be positive"),
        ([[1, 8, 2], [6, 4, 1]], "start must be <= end"),
        ([[1, 4, -1]], ">= 0"),
        ([[1, 8, 2], [8, 16, 1]], "non-overlapping"),
        ([[2, 8, 2]], "must start at 1"),
    ],
)
def test_bad_schedules_name_the_key(schedule: list[Any], problem: str) -> None:
    value = {**SCHEDULE, "num_speculative_tokens_per_batch_size": schedule}
    with pytest.raises(ValueError, match=problem) as raised:
        _group(value)
    assert "num_speculative_tokens_per_batch_size" in str(raised.value)


def test_the_cli_json_sets_the_group(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for example in (NGRAM, {**DRAFT, "model": str(tmp_path)}, SCHEDULE):
        ns = _parse("--speculative-config", json.dumps(example))
        assert config_from_namespace(ns, str(tmp_path)).speculative_config == _group(example)
    assert not config_from_namespace(_parse(), str(tmp_path)).speculative_config.enabled


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"method": "ngram", "num_speculative_tokens": 3', "expected a JSON object"),
        ("[1, 2]", "expected a JSON object"),
        ('{"method": "ngram", "num_speculative_tokens": 3, "k": 1}', r"\.k is an unknown key"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
        (
            json.dumps({**SCHEDULE, "num_speculative_tokens_per_batch_size": [[3, 9, 1]]}),
            "num_speculative_tokens_per_batch_size: the first batch-size range must start at 1",
        ),
    ],
)
def test_cli_errors_are_argparse_errors_naming_the_key(
    text: str, problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for command in (["serve", "m"], ["actor", "engine", "m"]):
        with pytest.raises(SystemExit) as exited:
            build_parser().parse_args([*command, "--speculative-config", text])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "argument --speculative-config" in err
        assert re.search(problem, err), err


def test_llm_takes_a_dict_or_the_group_and_refuses_bad_values(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # LLM(model, **options) builds its config with build_config before it starts anything.
    built = build_config(model=str(tmp_path), bus="memory", speculative_config=NGRAM)
    assert built.speculative_config == _group(NGRAM)
    group = _group({**DRAFT, "model": str(tmp_path)})
    assert build_config(model=str(tmp_path), speculative_config=group).speculative_config == group
    with pytest.raises(ValueError, match=r"speculative_config\.method must be one of"):
        LLM(str(tmp_path), speculative_config={"method": "medusa", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match=r"speculative_config\.prompt_lookup_min must be >= 1"):
        LLM(str(tmp_path), speculative_config={**NGRAM, "prompt_lookup_min": 0})


def test_shoal_actor_gives_every_actor_the_group(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = str(tmp_path)
    argv = ["--speculative-config", json.dumps(SCHEDULE), "--nats-url", "nats://h:1"]
    for kind in ("worker", "engine", "gateway"):
        ns = build_parser().parse_args(["actor", kind, model, *argv])
        config = config_from_namespace(ns, model)
        _, kwargs = actor_target(kind, config, ns.actor_id, ns)
        assert kwargs["config"].speculative_config == _group(SCHEDULE), kind
        # What the supervisor puts on the child's command line, read back as run_actor does.
        spec = ActorSpec("p", "x:Y", "nats://h:1", {"actor_id": "p", "config": config})
        command = spec.command()
        child = json.loads(command[command.index("--kwargs") + 1])
        probe = build_actor(_ConfigProbe, InMemoryBus(), child)
        assert isinstance(probe, _ConfigProbe) and probe.config == config


def test_options_replace_and_json_keep_the_group() -> None:
    config = ShoalConfig.from_options(model="m", speculative_config=SCHEDULE)
    assert ShoalConfig.from_options(**config.to_options()) == config
    assert msgspec.json.decode(msgspec.json.encode(config), type=ShoalConfig) == config
    assert config.replace(max_num_seqs=8).speculative_config == config.speculative_config
    assert not config.replace(speculative_config={}).speculative_config.enabled
    assert speculative_options(config.speculative_config)["num_speculative_tokens"] == 3


def test_a_missing_draft_model_directory_is_refused_before_anything_starts(tmp_path):
    from shoal.deploy.deployment import build_config

    spec = {"model": str(tmp_path / "absent"), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"speculative_config\.model: model directory not found"):
        build_config(model=str(tmp_path), speculative_config=spec)
    (tmp_path / "draft").mkdir()
    config = build_config(
        model=str(tmp_path), speculative_config={**spec, "model": str(tmp_path / "draft")}
    )
    assert config.speculative_config.speculative_method == "draft_model"
