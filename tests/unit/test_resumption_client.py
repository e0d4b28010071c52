"""The engine client's pure side of resumption: the output processor hides a resumable error
and re-keys the cut completions (late outputs of the old attempt are dropped), and
``Resumptions`` bounds how often and how long a request may wait to be resumed."""

from __future__ import annotations

import pytest

from shoal.bus.messages.engine import EngineCoreOutput, Logprobs
from shoal.bus.messages.sampling import OutputKind, SamplingParams
from shoal.config.deployment import FaultToleranceConfig
from shoal.engine.client.output_processor import LOST_OUTPUTS, OutputProcessor, ResumeRequest
from shoal.engine.client.resumption import Resumptions

PROMPT = [5, 6, 7]


def delta(n: int = 1, **params: object) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_tokens=10,
        output_kind=OutputKind.DELTA,
        n=n,
        **params,  # type: ignore[arg-type]
    )


def fault(request_id: str) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, [], "error", error="injected fault", resumable=True)


def streamed(processor: OutputProcessor, *outputs: EngineCoreOutput) -> list[list[int]]:
    result = processor.process_outputs(list(outputs))
    return [c.token_ids for out in result.request_outputs for c in out.outputs]


def test_a_resumable_error_is_hidden_and_the_completion_continues_under_a_fresh_id() -> None:
    processor = OutputProcessor(None, resume_on_fault=True)
    processor.add_request("r", PROMPT, delta())
    assert streamed(processor, EngineCoreOutput("r", [11, 12])) == [[11, 12]]
    result = processor.process_outputs([fault("r")])
    assert result.request_outputs == [] and result.finished_request_ids == []
    assert result.to_resume == {"r": "injected fault"}
    resume = processor.prepare_resume("r")
    assert resume is not None
    ((child, tokens),) = resume.children
    assert (child.request_id, tokens, resume.prompt_token_ids) == ("r@1", [11, 12], PROMPT)
    assert processor.owner_of("r") is None and processor.owner_of("r@1") == "r"
    assert streamed(processor, EngineCoreOutput("r", [99])) == []  # the old attempt: dropped
    result = processor.process_outputs([EngineCoreOutput("r@1", [13], "length")])
    ((completion,),) = [out.outputs for out in result.request_outputs]
    assert (completion.token_ids, completion.finish_reason) == ([13], "length")
    assert result.finished_request_ids == ["r"]
    assert processor.prepare_resume("r") is None


def test_an_output_after_lost_ones_is_not_taken_and_the_completion_resumes() -> None:
    """A bus connection cut mid-stream lost the output of the second token: the third one's
    (saying two tokens came before it, where the client has one) is dropped, its engine-side
    request aborted, and the completion resumes from the one token received."""
    processor = OutputProcessor(None, resume_on_fault=True)
    processor.add_request("r", PROMPT, delta())
    first = EngineCoreOutput("r", [11], num_prior_tokens=0)
    assert streamed(processor, first) == [[11]]
    result = processor.process_outputs([EngineCoreOutput("r", [13], num_prior_tokens=2)])
    assert result.request_outputs == [] and result.reqs_to_abort == ["r"]
    assert result.to_resume == {"r": LOST_OUTPUTS}
    resume = processor.prepare_resume("r")
    assert resume is not None and resume.children[0][1] == [11]
    # Said or not, outputs that follow what the client has are taken.
    assert streamed(processor, EngineCoreOutput("r@1", [12], num_prior_tokens=1)) == [[12]]
    assert streamed(processor, EngineCoreOutput("r@1", [13])) == [[13]]


def test_without_resumption_an_output_after_lost_ones_ends_the_request() -> None:
    processor = OutputProcessor(None)
    processor.add_request("r", PROMPT, delta())
    assert streamed(processor, EngineCoreOutput("r", [11], num_prior_tokens=0)) == [[11]]
    result = processor.process_outputs([EngineCoreOutput("r", [13], num_prior_tokens=2)])
    assert result.finished_request_ids == ["r"] and result.reqs_to_abort == ["r"]
    ((completion,),) = [out.outputs for out in result.request_outputs]
    assert (completion.token_ids, completion.finish_reason) == ([], "error")
    assert result.request_outputs[0].error == LOST_OUTPUTS


def test_without_resumption_a_resumable_error_ends_the_request() -> None:
    processor = OutputProcessor(None)
    processor.add_request("r", PROMPT, delta())
    result = processor.process_outputs([EngineCoreOutput("r", [11]), fault("r")])
    assert result.finished_request_ids == ["r"] and not result.to_resume
    assert result.request_outputs[-1].outputs[0].finish_reason == "error"


def test_only_unfinished_children_are_resumed_each_with_its_own_tokens() -> None:
    processor = OutputProcessor(None, resume_on_fault=True)
    processor.add_request("r", PROMPT, delta(n=3))
    processor.process_outputs(
        [
            EngineCoreOutput("0_r", [11], "length"),
            EngineCoreOutput("1_r", [21, 22]),
            fault("1_r"),
            fault("2_r"),
        ]
    )
    resume = processor.prepare_resume("r")
    assert resume is not None
    assert [(c.request_id, t) for c, t in resume.children] == [("1_r@1", [21, 22]), ("2_r@1", [])]
    again = processor.prepare_resume("r")  # a second fault: attempt 2
    assert again is not None
    assert [c.request_id for c, _ in again.children] == ["1_r@2", "2_r@2"]
    processor.process_outputs([EngineCoreOutput("2_r@2", [31], "length")])
    result = processor.process_outputs([EngineCoreOutput("1_r@2", [23], "length")])
    (out,) = result.request_outputs
    assert [c.index for c in out.outputs] == [1]  # DELTA: only what moved
    final = OutputProcessor(None, resume_on_fault=True)
    final.add_request("f", PROMPT, SamplingParams(temperature=0.0, max_tokens=10, n=2))
    final.process_outputs([EngineCoreOutput("1_f", [21], "length"), fault("0_f")])
    final.prepare_resume("f")
    (done,) = final.process_outputs([EngineCoreOutput("0_f@1", [11], "length")]).request_outputs
    assert [c.index for c in done.outputs] == [0, 1]  # in index order after re-keying


def test_prompt_logprobs_come_once_when_the_first_child_is_resumed_before_its_first_token() -> None:
    processor = OutputProcessor(None, resume_on_fault=True)
    processor.add_request("r", PROMPT, delta(prompt_logprobs=0))
    rows = Logprobs([[6], [7]], [[-1.0], [-2.0]], [1, 1])
    processor.process_outputs([EngineCoreOutput("r", [], prompt_logprobs=rows), fault("r")])
    processor.prepare_resume("r")  # the prompt runs whole again and sends its rows again
    result = processor.process_outputs([EngineCoreOutput("r@1", [11], prompt_logprobs=rows)])
    (out,) = result.request_outputs
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(PROMPT)


def payload() -> ResumeRequest:
    return ResumeRequest(PROMPT, 0.0, 0, [])


def make(**config: object) -> Resumptions:
    settings = {"enable_fault_tolerance": True, "request_resume_timeout_s": 5.0, **config}
    return Resumptions(FaultToleranceConfig(**settings))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "config", [{"enable_fault_tolerance": False}, {"enable_request_resumption": False}]
)
def test_resumption_is_off_unless_fault_tolerance_and_resumption_are_on(
    config: dict[str, bool],
) -> None:
    assert not make(**config).may_resume("r") and make().may_resume("r")


def test_a_request_is_resumed_at_most_max_times_and_rejections_do_not_count() -> None:
    resumptions = make(max_request_resumptions=2)
    for _ in range(2):
        assert resumptions.may_resume("r")
        resumptions.park("r", payload(), "e0", now=0.0)
        resumptions.park("r", payload(), "e1", now=0.0, counts=False)
    assert not resumptions.may_resume("r") and resumptions.may_resume("r", counts=False)
    assert resumptions.num_resumed("r") == 2 and resumptions.num_resumptions_total == 2
    resumptions.forget("r")
    assert resumptions.may_resume("r") and not resumptions.parked


def test_a_parked_request_expires_after_the_timeout_a_rejection_keeps_its_deadline() -> None:
    resumptions = make()
    resumptions.park("r", payload(), "e0", now=0.0)
    resumptions.unpark("r")
    resumptions.park("r", payload(), "e0", now=4.0, counts=False)  # turned away: same wait
    assert resumptions.take_expired(4.9) == []
    assert resumptions.take_expired(5.0) == ["r"] and not resumptions.parked
    resumptions.park("s", payload(), "e0", now=0.0)
    resumptions.park("s", payload(), "e0", now=4.0)  # a new fault: a new wait
    assert resumptions.take_expired(8.9) == []


def test_a_parked_request_avoids_its_engine_core_until_it_is_ready_again() -> None:
    resumptions = make()
    resumptions.park("r", payload(), "e0", now=0.0)
    resumptions.engine_ready_again("e1")
    assert resumptions.parked["r"].avoid == "e0"
    resumptions.engine_ready_again("e0")
    assert resumptions.parked["r"].avoid is None
