"""Turning async scheduling on and off: on by default, ``--async-scheduling`` /
``--no-async-scheduling`` on ``shoal serve`` and ``shoal actor``, and ``LLM(async_scheduling=)``
reaching the engine core actor (one step in flight at a time when off)."""

from __future__ import annotations

import pytest

from shoal.bus.messages.sampling import SamplingParams
from shoal.config.deployment import SchedulerConfig
from shoal.deploy.arguments import config_from_namespace
from shoal.deploy.cli import build_parser
from shoal.deploy.llm import LLM
from shoal.engine.actor.core_actor import EngineCoreActor

pytestmark = pytest.mark.timeout(120)


def test_on_by_default() -> None:
    assert SchedulerConfig().async_scheduling is True


@pytest.mark.parametrize(
    ("command", "flag", "want"),
    [
        (["serve", "M"], [], True),
        (["serve", "M"], ["--no-async-scheduling"], False),
        (["serve", "M"], ["--async-scheduling"], True),
        (["actor", "engine", "M"], ["--no-async-scheduling"], False),
        (["actor", "worker", "M"], [], True),
    ],
)
def test_flags(tmp_path, command: list[str], flag: list[str], want: bool) -> None:  # type: ignore[no-untyped-def]
    ns = build_parser().parse_args([*command, *flag])
    assert ns.async_scheduling is want
    config = config_from_namespace(ns, str(tmp_path))
    assert config.scheduler_config.async_scheduling is want


@pytest.mark.parametrize("async_on", [True, False])
def test_llm_option_reaches_the_engine_core(tiny_checkpoint, async_on: bool) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(str(tiny_checkpoint("llama")), async_scheduling=async_on, max_num_seqs=4)
    try:
        assert llm.config.scheduler_config.async_scheduling is async_on
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}]
        outputs = llm.generate(prompts, params)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [12, 12]
        engine = next(a for a in llm._actors if isinstance(a, EngineCoreActor))
        assert engine.core is not None
        assert engine.core.stats().max_steps_in_flight == (2 if async_on else 1)
    finally:
        llm.shutdown()
