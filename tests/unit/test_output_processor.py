"""Output processor: output kinds, stop tokens and strings, n > 1, logprobs, timestamps."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.bus.messages.engine import EngineCoreOutput, EngineOutputs, Logprobs
from shoal.bus.messages.sampling import OutputKind, SamplingParams
from shoal.engine.client.output_processor import OutputProcessor
from shoal.engine.client.outputs import RequestOutput
from shoal.engine.client.tokenizer import Tokenizer
from shoal.workers.demo.tokenizer import save_tokenizer

TEXT = "hello world, café 你好 😀 and more words"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    model_dir: Path = tmp_path_factory.mktemp("tok")
    save_tokenizer([TEXT * 3, "hello world " * 4], vocab_size=300, out_dir=model_dir)
    return Tokenizer.from_pretrained(model_dir)


def batch(*outputs: EngineCoreOutput) -> EngineOutputs:
    return EngineOutputs(engine_id="e0", outputs=list(outputs), timestamp=0.0)


def run_tokens(
    processor: OutputProcessor,
    request_id: str,
    ids: list[int],
    finish: str = "length",
    stop_reason: int | None = None,
) -> list[RequestOutput]:
    """One token per step; the last step carries ``finish``."""
    outputs: list[RequestOutput] = []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        step = EngineCoreOutput(
            request_id, [token], finish if last else None, stop_reason if last else None
        )
        outputs += processor.process_outputs(batch(step), now=float(i)).request_outputs
    return outputs


def add(processor: OutputProcessor, tokenizer: Tokenizer, rid: str = "r", **params: object) -> None:
    processor.add_request(
        rid, tokenizer.encode("prompt"), SamplingParams(**params), prompt="prompt"
    )


@pytest.mark.parametrize("kind", list(OutputKind))
def test_every_output_kind_reproduces_the_full_decode(
    tokenizer: Tokenizer, kind: OutputKind
) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, output_kind=kind, max_tokens=len(ids))
    outputs = run_tokens(processor, "r", ids)
    assert outputs[-1].finished and all(not o.finished for o in outputs[:-1])
    completions = [o.outputs[0] for o in outputs]
    if kind == OutputKind.DELTA:
        assert len(outputs) == len(ids)
        assert "".join(c.text for c in completions) == TEXT
        assert [t for c in completions for t in c.token_ids] == ids
    else:
        assert len(outputs) == (1 if kind == OutputKind.FINAL_ONLY else len(ids))
        assert all(TEXT.startswith(c.text) for c in completions)
        assert completions[-1].text == TEXT and completions[-1].token_ids == ids
    assert not any("\ufffd" in c.text for c in completions)
    assert completions[-1].finish_reason == "length"
    assert processor.num_requests == 0


def test_stop_token_is_kept_in_ids_but_not_in_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("hello world!", add_special_tokens=False)
    stop_id = ids[-1]
    for include, text in [(False, "hello world"), (True, "hello world!")]:
        processor = OutputProcessor(tokenizer)
        add(processor, tokenizer, stop_token_ids=[stop_id], include_stop_str_in_output=include)
        final = run_tokens(processor, "r", ids, finish="stop", stop_reason=stop_id)[-1].outputs[0]
        assert (final.text, final.token_ids) == (text, ids)
        assert (final.finish_reason, final.stop_reason) == ("stop", stop_id)


def test_eos_ends_with_stop_and_no_reason(tokenizer: Tokenizer) -> None:
    eos = tokenizer.eos_token_ids[0]
    ids = [*tokenizer.encode("hello", add_special_tokens=False), eos]
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, skip_special_tokens=False)
    final = run_tokens(processor, "r", ids, finish="stop")[-1].outputs[0]
    assert (final.text, final.finish_reason, final.stop_reason) == ("hello", "stop", None)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_finishes_trims_and_asks_for_an_engine_abort(
    tokenizer: Tokenizer, include: bool
) -> None:
    ids = tokenizer.encode("hello world and more words", add_special_tokens=False)
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, stop=["world"], include_stop_str_in_output=include)
    # All tokens in one step: the ones after the stop string are dropped.
    result = processor.process_outputs(batch(EngineCoreOutput("r", ids)))
    assert result.reqs_to_abort == ["r"] and result.finished_request_ids == ["r"]
    final = result.request_outputs[0]
    completion = final.outputs[0]
    assert final.finished
    assert completion.text == ("hello world" if include else "hello ")
    assert (completion.finish_reason, completion.stop_reason) == ("stop", "world")
    assert tokenizer.decode(completion.token_ids).endswith("world")
    assert len(completion.token_ids) < len(ids)
    # The engine core's next output for it (sent before the abort landed) is ignored.
    assert processor.process_outputs(batch(EngineCoreOutput("r", ids[:1]))).request_outputs == []


def test_stop_string_in_the_engines_final_step_needs_no_abort(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, stop=["world"])
    result = processor.process_outputs(batch(EngineCoreOutput("r", ids, "length")))
    assert result.reqs_to_abort == []
    assert result.request_outputs[0].outputs[0].stop_reason == "world"


def test_stop_string_within_min_tokens_is_ignored(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("hello world hello world", add_special_tokens=False)
    first = len(tokenizer.encode("hello world", add_special_tokens=False))
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, stop=["world"], min_tokens=first)
    final = run_tokens(processor, "r", ids)[-1].outputs[0]
    assert final.text == "hello world hello "
    assert final.stop_reason == "world"


def test_delta_stream_holds_back_a_possible_stop_prefix(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, stop=["zzzz"], output_kind=OutputKind.DELTA)
    outputs = run_tokens(processor, "r", ids)
    joined = ""
    for i, output in enumerate(outputs[:-1]):
        joined += output.outputs[0].text
        assert joined == tokenizer.decode(ids[: i + 1])[:-3]
    assert joined + outputs[-1].outputs[0].text == TEXT


def test_n_children_have_their_own_ids_and_seeds(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    children = processor.add_request("r", [1, 2], SamplingParams(n=3, seed=7))
    assert [c.request_id for c in children] == ["0_r", "1_r", "2_r"]
    assert [(c.sampling_params.n, c.sampling_params.seed) for c in children] == [
        (1, 7),
        (1, 8),
        (1, 9),
    ]
    unseeded = processor.add_request("u", [1], SamplingParams(n=2))
    assert [c.sampling_params.seed for c in unseeded] == [None, None]
    single = processor.add_request("s", [1], SamplingParams(seed=3))
    assert [(c.request_id, c.sampling_params.seed) for c in single] == [("s", 3)]


def run_two_children(processor: OutputProcessor, ids: list[int]) -> list[RequestOutput]:
    """Child 0 finishes at step 1, child 1 at step 2; both move at step 0."""
    steps = [
        [EngineCoreOutput("0_r", ids[:1]), EngineCoreOutput("1_r", ids[:1])],
        [EngineCoreOutput("0_r", ids[1:2], "length")],
        [EngineCoreOutput("1_r", ids[1:3], "length")],
    ]
    outputs = []
    for step in steps:
        outputs += processor.process_outputs(batch(*step)).request_outputs
    return outputs


def test_n_children_aggregate_in_each_output_kind(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("hello world again", add_special_tokens=False)
    results = {}
    for kind in OutputKind:
        processor = OutputProcessor(tokenizer)
        processor.add_request("r", [1], SamplingParams(n=2, output_kind=kind))
        results[kind] = run_two_children(processor, ids)
        assert [o.finished for o in results[kind]][-1] is True
        assert sum(o.finished for o in results[kind]) == 1
    final_only = results[OutputKind.FINAL_ONLY]
    assert len(final_only) == 1
    assert [c.token_ids for c in final_only[0].outputs] == [ids[:2], ids[:3]]
    cumulative = results[OutputKind.CUMULATIVE]
    assert [[c.index for c in o.outputs] for o in cumulative] == [[0, 1], [0, 1], [0, 1]]
    assert cumulative[-1].outputs[1].token_ids == ids[:3]
    assert cumulative[-1].outputs[0].finish_reason == "length"
    delta = results[OutputKind.DELTA]
    assert [[(c.index, c.token_ids) for c in o.outputs] for o in delta] == [
        [(0, ids[:1]), (1, ids[:1])],
        [(0, ids[1:2])],
        [(1, ids[1:3])],
    ]


def test_logprobs_become_dicts_with_ranks_and_decoded_tokens(tokenizer: Tokenizer) -> None:
    a, b, c = tokenizer.encode("hello world!", add_special_tokens=False)[:3]
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, logprobs=2, output_kind=OutputKind.DELTA)
    rows1 = Logprobs(token_ids=[[a, b, a]], logprobs=[[-1.5, -0.5, -1.5]], ranks=[2])
    rows2 = Logprobs(token_ids=[[c, c, a]], logprobs=[[-0.25, -0.25, -2.0]], ranks=[1])
    out1 = processor.process_outputs(batch(EngineCoreOutput("r", [a], new_logprobs=rows1)))
    out2 = processor.process_outputs(
        batch(EngineCoreOutput("r", [c], "length", new_logprobs=rows2))
    )
    first = out1.request_outputs[0].outputs[0]
    assert first.logprobs is not None
    position = first.logprobs[0]
    assert list(position) == [a, b]
    assert (position[a].logprob, position[a].rank) == (-1.5, 2)
    assert (position[b].logprob, position[b].rank) == (-0.5, 1)
    assert position[a].decoded_token == tokenizer.decode([a])
    second = out2.request_outputs[0].outputs[0]
    assert second.logprobs is not None and len(second.logprobs) == 1
    assert second.logprobs[0][c].rank == 1
    assert second.cumulative_logprob == pytest.approx(-1.75)


def test_no_logprobs_unless_asked(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer)
    (output,) = run_tokens(processor, "r", tokenizer.encode("hi", add_special_tokens=False)[:1])
    assert output.outputs[0].logprobs is None and output.outputs[0].cumulative_logprob is None


def test_prompt_logprobs_start_with_none(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", [5, 6, 7], SamplingParams(prompt_logprobs=0))
    rows = Logprobs(token_ids=[[6], [7]], logprobs=[[-1.0], [-2.0]], ranks=[3, 1])
    result = processor.process_outputs(
        batch(EngineCoreOutput("r", [8], "length", prompt_logprobs=rows))
    )
    prompt_logprobs = result.request_outputs[0].prompt_logprobs
    assert prompt_logprobs is not None and prompt_logprobs[0] is None
    assert [p[t].rank for p, t in zip(prompt_logprobs[1:], [6, 7], strict=True)] == [3, 1]


def test_delta_prompt_logprobs_of_a_chunked_prefill_arrive_whole(tokenizer: Tokenizer) -> None:
    """A prefill split over steps sends its prompt logprobs in parts; a DELTA consumer (the
    gateway's echo) gets all of them with the first output, not just the first part."""
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(prompt_logprobs=0, output_kind=OutputKind.DELTA)
    processor.add_request("r", [5, 6, 7, 9], params)

    def rows(*token_ids: int) -> Logprobs:
        return Logprobs([[t] for t in token_ids], [[-1.0] for _ in token_ids], [1] * len(token_ids))

    outputs = []
    for step in (
        EngineCoreOutput("r", [], prompt_logprobs=rows(6)),
        EngineCoreOutput("r", [], prompt_logprobs=rows(7)),
        EngineCoreOutput("r", [8], prompt_logprobs=rows(9)),
        EngineCoreOutput("r", [8], "length"),
    ):
        outputs += processor.process_outputs(batch(step)).request_outputs
    sent = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
    assert len(sent) == 1
    assert sent[0][0] is None and [list(p) for p in sent[0][1:]] == [[6], [7], [9]]
    assert [t for o in outputs for c in o.outputs for t in c.token_ids] == [8, 8]


def test_latency_timestamps(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", [1], SamplingParams(), arrival_time=100.0)
    processor.process_outputs(batch(EngineCoreOutput("r", [10])), now=101.0)
    processor.process_outputs(batch(EngineCoreOutput("r", [11])), now=102.0)
    final = processor.process_outputs(batch(EngineCoreOutput("r", [12], "length")), now=103.0)
    metrics = final.request_outputs[0].metrics
    assert metrics is not None
    assert (metrics.arrival_time, metrics.first_token_time) == (100.0, 101.0)
    assert (metrics.last_token_time, metrics.finished_time) == (103.0, 103.0)


def test_abort_and_fail(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", [1], SamplingParams(n=2))
    processor.process_outputs(batch(EngineCoreOutput("0_r", [10], "length")))
    assert processor.engine_request_ids("r") == ["1_r"]
    assert processor.abort_request("r") == ["1_r"]
    assert processor.num_requests == 0 and processor.abort_request("r") == []
    processor.add_request("f", [1], SamplingParams())
    failed = processor.fail_request("f", "engine core died")
    assert failed is not None and failed.finished and failed.error == "engine core died"
    assert failed.outputs[0].finish_reason == "error"
    assert processor.fail_request("f", "again") is None


def test_engine_error_and_unknown_ids(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", [1], SamplingParams())
    with pytest.raises(ValueError, match="already in flight"):
        processor.add_request("r", [1], SamplingParams())
    result = processor.process_outputs(
        batch(
            EngineCoreOutput("ghost", [1]), EngineCoreOutput("r", [], "error", error="worker lost")
        )
    )
    (output,) = result.request_outputs
    assert output.finished and output.error == "worker lost"
    assert output.outputs[0].finish_reason == "error"


def test_detokenize_off_gives_ids_only_and_ignores_stop_strings(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, detokenize=False, stop=["world"])
    final = run_tokens(processor, "r", ids)[-1].outputs[0]
    assert (final.text, final.token_ids, final.finish_reason) == ("", ids, "length")
