"""The client side of disaggregated prefill: which requests a prefill engine core prefills
(``engine.client.disagg_routing``) and what the output processor makes of its answer.

``DisaggRouting`` keeps a prompt whose uncached part is at most ``max_local_prefill_length``
tokens on its decode engine core, and sends a longer one to a ready prefill engine core whose
waiting requests (as reported, plus those sent since) are at most ``max_prefill_queue_size``;
``n`` > 1, ``max_tokens`` 1 and a disabled configuration never go there, and each decision is
counted. The router gives a plain request a ``both``/``decode`` engine core while one is ready,
a prefill one only when nothing else is. The ``OutputProcessor``: a request marked as prefilled
remotely whose prefill ends "length" with held KV is handed over (its token goes to the
caller, it stays unfinished, ``continuation`` gives it back under the same engine-side id); one
whose first token completes a stop string finishes there and its held KV is released instead of
aborted; unmarked (or re-marked by ``prepare_resume``) the same output just finishes it."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.bus.messages.control import ActorState, StatusEvent
from shoal.bus.messages.engine import (
    EngineCoreOutput,
    EngineOutputs,
    EngineStats,
    KVTransferParams,
    SchedulerStats,
)
from shoal.bus.messages.kv_events import BlockStored, KVEventBatch
from shoal.bus.messages.sampling import SamplingParams
from shoal.config.disaggregation import DisaggregationConfig
from shoal.engine.client.disagg_routing import (
    DisaggRouting,
    continued_params,
    disaggregable,
    prefill_params,
)
from shoal.engine.client.output_processor import (
    ChildRequest,
    OutputProcessor,
    ProcessedOutputs,
    ResumeRequest,
)
from shoal.engine.client.prefix_index import PrefixIndex
from shoal.engine.client.router import PREFILL_ROLES, EngineRouter, EngineView
from shoal.engine.client.tokenizer import Tokenizer
from shoal.workers.demo.tokenizer import save_tokenizer

BLOCK = 4
MAX_LOCAL = 100  # max_local_prefill_length
MAX_QUEUE = 2  # max_prefill_queue_size
PLAIN = SamplingParams(max_tokens=16)
ARRIVAL = 5.0


# ----- DisaggRouting


def stats(engine_id: str, role: str, num_waiting: int = 0, num_running: int = 0) -> EngineStats:
    return EngineStats(
        engine_id,
        SchedulerStats(num_running=num_running, num_waiting=num_waiting),
        0.0,
        block_size=BLOCK,
        kv_role=role,
    )


def router_of(*engines: EngineStats, index: PrefixIndex | None = None) -> EngineRouter:
    """A router that has heard from these engine cores just now (ready: they never go stale
    within a test)."""
    router = EngineRouter(stale_after_s=1e9, index=index)
    for engine in engines:
        assert router.on_stats(engine)
    return router


def config(**changes: object) -> DisaggregationConfig:
    fields: dict[str, object] = {
        "num_prefill": 1,
        "num_decode": 1,
        "max_local_prefill_length": MAX_LOCAL,
        "max_prefill_queue_size": MAX_QUEUE,
    }
    fields.update(changes)
    return DisaggregationConfig(**fields)  # type: ignore[arg-type]


def chosen(
    routing: DisaggRouting, prompt_len: int, params: SamplingParams = PLAIN, decode: str = "d0"
) -> str | None:
    view = routing.prefill_engine("r", routing.router.engines[decode], prompt_len, params)
    return None if view is None else view.engine_id


def counts(routing: DisaggRouting) -> tuple[int, int]:
    return routing.num_remote, routing.num_local


def test_a_prompt_longer_than_the_local_limit_is_prefilled_on_the_prefill_engine() -> None:
    router = router_of(stats("p0", "prefill"), stats("d0", "decode"))
    routing = DisaggRouting(config(), router)
    assert chosen(routing, MAX_LOCAL) is None  # at the limit: stays local
    assert counts(routing) == (0, 1)
    assert chosen(routing, MAX_LOCAL + 1) == "p0"
    assert counts(routing) == (1, 1)
    assert router.engines["p0"].num_sent_since_stats == 1  # counted as sent there
    assert router.engines["d0"].num_sent_since_stats == 0  # (the caller's pick counts that)
    assert chosen(routing, 10) is None and counts(routing) == (1, 2)


def test_the_cached_part_of_the_prompt_does_not_count_toward_the_limit() -> None:
    index = PrefixIndex()
    router = router_of(stats("p0", "prefill"), stats("d0", "decode"), index=index)
    hashes = [i.to_bytes(4, "little") for i in range(30)]
    index.apply(KVEventBatch("d0", "", 0, [BlockStored(hashes[:5])]))  # 20 tokens on d0
    routing = DisaggRouting(config(), router)
    decode = router.engines["d0"]
    assert routing.prefill_engine("r", decode, MAX_LOCAL + 20, PLAIN, hashes) is None
    view = routing.prefill_engine("r", decode, MAX_LOCAL + 21, PLAIN, hashes)
    assert view is not None and view.engine_id == "p0"
    assert counts(routing) == (1, 1)


def test_a_prefill_engine_with_a_long_queue_is_not_used() -> None:
    router = router_of(stats("p0", "prefill", num_waiting=MAX_QUEUE + 1), stats("d0", "decode"))
    routing = DisaggRouting(config(), router)
    assert chosen(routing, 500) is None and counts(routing) == (0, 1)
    router.on_stats(stats("p0", "prefill", num_waiting=MAX_QUEUE - 1, num_running=50))
    assert chosen(routing, 500) == "p0"  # running requests do not count: waiting ones do
    # ... as reported plus sent since: 1 + 1 is at the limit still, 1 + 2 is past it.
    assert chosen(routing, 500) == "p0"
    assert chosen(routing, 500) is None
    assert counts(routing) == (2, 2)


def test_a_full_prefill_engine_leaves_the_request_to_another_one() -> None:
    router = router_of(
        stats("p0", "prefill", num_waiting=MAX_QUEUE + 1),
        stats("p1", "prefill", num_waiting=MAX_QUEUE, num_running=9),
        stats("d0", "decode"),
        stats("b0", "both"),
    )
    routing = DisaggRouting(config(), router)
    assert chosen(routing, 500) == "p1"  # less loaded p0 is full; never a decode/both one
    assert chosen(routing, 500) is None  # p1 is full now too: prefilled on d0
    assert counts(routing) == (1, 1)


def test_a_prefill_engine_that_is_not_ready_is_not_used() -> None:
    router = router_of(stats("p0", "prefill"), stats("d0", "decode"))
    router.liveness.on_event(StatusEvent("p0", "engine", ActorState.UNHEALTHY, 0.0))
    routing = DisaggRouting(config(), router)
    assert chosen(routing, 500) is None and counts(routing) == (0, 1)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(n=2, max_tokens=16), SamplingParams(max_tokens=1)],
    ids=["n2", "max_tokens1"],
)
def test_only_one_completion_that_runs_past_its_first_token_is_disaggregated(
    params: SamplingParams,
) -> None:
    router = router_of(stats("p0", "prefill"), stats("d0", "decode"))
    routing = DisaggRouting(config(), router)
    assert not disaggregable(params)
    assert chosen(routing, 5000, params) is None
    assert counts(routing) == (0, 0)  # not a candidate: counted neither way
    assert disaggregable(SamplingParams(max_tokens=None)) and disaggregable(PLAIN)
    assert chosen(routing, 5000, SamplingParams(max_tokens=None)) == "p0"


def test_a_disabled_configuration_never_disaggregates() -> None:
    router = router_of(stats("p0", "prefill"), stats("d0", "decode"))
    routing = DisaggRouting(DisaggregationConfig(max_local_prefill_length=0), router)
    assert not routing.enabled
    assert chosen(routing, 5000) is None and counts(routing) == (0, 0)
    assert router.engines["p0"].num_sent_since_stats == 0


def test_the_parameters_on_each_side() -> None:
    params = SamplingParams(max_tokens=16, min_tokens=4, prompt_logprobs=2, temperature=0.5)
    prefill = prefill_params(params)
    assert (prefill.max_tokens, prefill.min_tokens, prefill.prompt_logprobs) == (1, 1, 2)
    assert prefill.temperature == 0.5
    decode = continued_params(params)
    assert (decode.max_tokens, decode.min_tokens, decode.prompt_logprobs) == (16, 4, None)


# ----- the router's roles


def picked(router: EngineRouter, **kwargs: object) -> str | None:
    view: EngineView | None = router.pick(**kwargs)  # type: ignore[arg-type]
    return None if view is None else view.engine_id


def test_a_plain_request_goes_to_a_prefill_engine_only_when_nothing_else_is_ready() -> None:
    router = router_of(
        stats("p0", "prefill"),  # the least loaded by far
        stats("d0", "decode", num_running=5),
        stats("b0", "both", num_running=7),
    )
    assert [picked(router) for _ in range(4)] == ["d0", "d0", "d0", "b0"]  # 5, 6, 7 vs 7
    assert picked(router, roles=PREFILL_ROLES) == "p0"
    router.liveness.on_event(StatusEvent("d0", "engine", ActorState.UNHEALTHY, 0.0))
    assert picked(router) == "b0"
    router.liveness.on_event(StatusEvent("b0", "engine", ActorState.DEAD, 0.0))
    assert picked(router) == "p0"  # better than nothing
    assert picked(router, exclude="p0") is None


# ----- the output processor's handover


HELD = KVTransferParams(
    do_remote_decode=True,
    remote_engine_id="p0",
    remote_block_ids=[3, 4],
    num_remote_tokens=6,
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    model_dir: Path = tmp_path_factory.mktemp("tok")
    text = "hello world, and more words to split into tokens"
    save_tokenizer([text * 3, "hello world " * 4], vocab_size=300, out_dir=model_dir)
    return Tokenizer.from_pretrained(model_dir)


def first_token(tokenizer: Tokenizer) -> tuple[int, str]:
    """A token with some text of its own, and that text."""
    for token in tokenizer.encode("hello world", add_special_tokens=False):
        text = tokenizer.decode([token])
        if text.strip():
            return token, text
    raise AssertionError("no token with text")


def processor_with(
    tokenizer: Tokenizer, remote: bool = True, **params: object
) -> tuple[OutputProcessor, list[int]]:
    processor = OutputProcessor(tokenizer)
    prompt = tokenizer.encode("prompt")
    sampling = SamplingParams(max_tokens=16, **params)  # type: ignore[arg-type]
    processor.add_request("r", prompt, sampling, arrival_time=ARRIVAL)
    if remote:
        processor.mark_remote_prefill("r")
    return processor, prompt


def prefill_final(
    token: int, request_id: str = "r", changes: dict[str, object] | None = None
) -> EngineOutputs:
    """A prefill engine core's only output: the first token, capped at max_tokens 1, with the
    KV it holds (unless ``changes`` say otherwise)."""
    fields: dict[str, object] = {"finish_reason": "length", "kv_transfer_params": HELD}
    fields.update(changes or {})
    output = EngineCoreOutput(request_id, [token], **fields)  # type: ignore[arg-type]
    return EngineOutputs(engine_id="p0", outputs=[output], timestamp=0.0)


def moved(result: ProcessedOutputs) -> tuple[object, ...]:
    return (
        result.to_hand_over,
        result.to_release,
        result.reqs_to_abort,
        result.finished_request_ids,
    )


def test_a_remote_prefills_end_hands_the_request_over_with_its_first_token(
    tokenizer: Tokenizer,
) -> None:
    processor, prompt = processor_with(tokenizer)
    token, text = first_token(tokenizer)
    result = processor.process_outputs(prefill_final(token), now=1.0)
    assert moved(result) == ({"r": HELD}, [], [], [])
    (output,) = result.request_outputs
    assert not output.finished
    (completion,) = output.outputs
    assert completion.token_ids == [token] and completion.text == text
    assert completion.finish_reason is None
    assert processor.num_requests == 1 and processor.engine_request_ids("r") == ["r"]
    assert processor.continuation("r") == ResumeRequest(
        prompt, ARRIVAL, 0, [(ChildRequest("r", SamplingParams(max_tokens=16)), [token])]
    )
    # The decode engine core goes on under the same id; its "length" is the request's end.
    second = tokenizer.encode("world", add_special_tokens=False)[0]
    end = EngineOutputs(
        engine_id="d0",
        outputs=[EngineCoreOutput("r", [second], "length", kv_transfer_params=HELD)],
        timestamp=0.0,
    )
    result = processor.process_outputs(end, now=2.0)
    assert moved(result) == ({}, [], [], ["r"])
    (output,) = result.request_outputs
    assert output.finished and output.outputs[0].token_ids == [token, second]
    assert output.outputs[0].finish_reason == "length"
    assert processor.continuation("r") is None


def test_a_first_token_that_completes_a_stop_string_releases_the_held_kv(
    tokenizer: Tokenizer,
) -> None:
    token, text = first_token(tokenizer)
    processor, _ = processor_with(tokenizer, stop=[text.strip()])
    result = processor.process_outputs(prefill_final(token), now=1.0)
    assert moved(result) == ({}, [("p0", "r")], [], ["r"])  # released there, not aborted
    (output,) = result.request_outputs
    assert output.finished and output.outputs[0].finish_reason == "stop"
    assert processor.num_requests == 0 and processor.continuation("r") is None


def test_an_unmarked_request_just_finishes_on_the_same_output(tokenizer: Tokenizer) -> None:
    token, _ = first_token(tokenizer)
    processor, _ = processor_with(tokenizer, remote=False)
    result = processor.process_outputs(prefill_final(token), now=1.0)
    assert moved(result) == ({}, [], [], ["r"])
    (output,) = result.request_outputs
    assert output.finished and output.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "changes",
    [
        {"kv_transfer_params": None},  # the prefill engine core held nothing
        {"kv_transfer_params": KVTransferParams()},  # ... nor said it does
        {"finish_reason": "stop", "stop_reason": 2},  # stopped: nothing to decode
    ],
    ids=["no_params", "no_remote_decode", "stopped"],
)
def test_a_marked_request_finishes_when_its_prefill_holds_nothing_for_it(
    tokenizer: Tokenizer, changes: dict[str, object]
) -> None:
    token, _ = first_token(tokenizer)
    processor, _ = processor_with(tokenizer)
    result = processor.process_outputs(prefill_final(token, changes=changes), now=1.0)
    assert moved(result) == ({}, [], [], ["r"])


def test_prepare_resume_clears_the_mark(tokenizer: Tokenizer) -> None:
    token, _ = first_token(tokenizer)
    processor, _ = processor_with(tokenizer)
    payload = processor.prepare_resume("r")  # its prefill engine core failed: resumed whole
    assert payload is not None
    ((child, tokens),) = payload.children
    assert child.request_id == "r@1" and tokens == []
    result = processor.process_outputs(prefill_final(token, request_id="r@1"), now=1.0)
    assert moved(result) == ({}, [], [], ["r"])
    assert result.request_outputs[0].finished


def test_a_request_prefilled_remotely_continues_on_its_decode_engine_while_it_is_ready() -> None:
    router = router_of(stats("p0", "prefill"), stats("d0", "decode"), stats("d1", "decode", 5))
    routing = DisaggRouting(config(), router)
    for request_id in ("a", "b", "c"):
        assert routing.prefill_engine(request_id, router.engines["d1"], MAX_LOCAL + 1, PLAIN)
    view = routing.decode_engine("a")
    assert view is not None and view.engine_id == "d1"  # the one chosen, not the least loaded
    routing.forget("b")
    view = routing.decode_engine("b")  # forgotten: the router's pick now
    assert view is not None and view.engine_id == "d0"
    router.liveness.reset("d1", state=ActorState.UNHEALTHY)
    view = routing.decode_engine("c")  # its decode engine is no longer ready
    assert view is not None and view.engine_id == "d0"
