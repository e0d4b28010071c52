"""Request model, statuses, sampling parameters and configs."""

from __future__ import annotations

import pytest

from shoal.bus.messages.engine import AddRequest
from shoal.bus.messages.sampling import OutputKind, SamplingParams
from shoal.config.deployment import CacheConfig, SchedulerConfig
from shoal.engine.core.block_hash import BlockHasher
from shoal.engine.core.request import FINISH_REASONS, Request, RequestStatus
from shoal.engine.core.scheduler import Scheduler
from tests.unit.factories import make_request


def test_statuses_are_ordered_and_map_to_finish_reasons() -> None:
    assert not RequestStatus.is_finished(RequestStatus.WAITING)
    assert not RequestStatus.is_finished(RequestStatus.RUNNING)
    assert not RequestStatus.is_finished(RequestStatus.PREEMPTED)
    finished = [s for s in RequestStatus if RequestStatus.is_finished(s)]
    assert finished == [
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_IGNORED,
        RequestStatus.FINISHED_ERROR,
    ]
    assert [FINISH_REASONS[s] for s in finished] == ["stop", "length", "abort", "length", "error"]
    assert str(RequestStatus.RUNNING) == "RUNNING"


def test_from_add_carries_every_field_and_hashes_full_blocks() -> None:
    msg = AddRequest(
        "r1",
        list(range(10)),
        SamplingParams(max_tokens=5, ignore_eos=False, stop_token_ids=[7]),
        client_id="c9",
        arrival_time=12.5,
        eos_token_ids=[2, 3],
        priority=4,
        cache_salt="s",
    )
    request = Request.from_add(msg, BlockHasher(4))
    assert (request.request_id, request.client_id, request.priority) == ("r1", "c9", 4)
    assert (request.arrival_time, request.cache_salt, request.max_tokens) == (12.5, "s", 5)
    assert request.eos_token_ids == [2, 3]
    assert request.stop_eos_ids == {2, 3} and request.stop_token_ids == {7}
    assert request.status is RequestStatus.WAITING
    assert len(request.block_hashes) == 2  # 10 tokens, block size 4: two full blocks
    request.append_output_token_id(50)
    assert len(request.block_hashes) == 2
    request.append_output_token_id(51)
    assert len(request.block_hashes) == 3
    assert request.num_tokens == 12 and request.num_output_tokens == 2
    assert request.output_token_ids == [50, 51]
    assert request.prompt_token_ids == list(range(10))  # the prompt is never extended


def test_ignore_eos_empties_the_stop_eos_set() -> None:
    request = make_request("r", [5, 6], ignore_eos=True, eos_token_ids=[2])
    assert request.stop_eos_ids == frozenset()
    assert request.eos_token_ids == [2]  # still sent to the worker


def test_request_id_must_be_a_string_and_prompt_not_empty() -> None:
    with pytest.raises(TypeError, match="request_id"):
        Request(5, [1], SamplingParams())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request("r", [], SamplingParams())


def test_priority_order_is_priority_then_arrival_then_id() -> None:
    a = make_request("a", [1], priority=1, arrival_time=5.0)
    b = make_request("b", [1], priority=0, arrival_time=9.0)
    c = make_request("c", [1], priority=0, arrival_time=1.0)
    d = make_request("d", [1], priority=0, arrival_time=1.0)
    assert sorted([a, b, c, d]) == [c, d, b, a]


def test_final_output_carries_reason_and_error() -> None:
    request = make_request("r", [1, 2])
    request.status = RequestStatus.FINISHED_ERROR
    request.error = "worker died"
    output = request.make_final_output()
    assert (output.request_id, output.new_token_ids) == ("r", [])
    assert (output.finish_reason, output.error) == ("error", "worker died")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_k", -2),
        ("min_p", 1.5),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("logprobs", 99),
        ("prompt_logprobs", -1),
        ("stop_token_ids", [-1]),
    ],
)
def test_invalid_sampling_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_sampling_defaults_follow_vllm() -> None:
    params = SamplingParams()
    assert (params.n, params.max_tokens, params.min_tokens, params.temperature) == (1, 16, 0, 1.0)
    assert (params.top_p, params.top_k, params.min_p, params.seed) == (1.0, 0, 0.0, None)
    assert (params.ignore_eos, params.skip_special_tokens) == (False, True)
    assert params.include_stop_str_in_output is False
    assert params.output_kind is OutputKind.CUMULATIVE
    assert SamplingParams(stop="x").stop == ["x"]


def test_a_whole_prompt_must_fit_one_step_without_chunked_prefill() -> None:
    config = SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(config, CacheConfig(num_gpu_blocks_override=8), max_model_len=32)
    assert Scheduler(config, CacheConfig(num_gpu_blocks_override=8), max_model_len=16)


def test_block_count_must_be_known() -> None:
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        Scheduler(SchedulerConfig(), CacheConfig(), max_model_len=64)
    scheduler = Scheduler(
        SchedulerConfig(), CacheConfig(num_gpu_blocks_override=20), max_model_len=64
    )
    assert scheduler.num_blocks == 20
    assert (
        Scheduler(SchedulerConfig(), CacheConfig(), max_model_len=64, num_blocks=10).num_blocks
        == 10
    )
