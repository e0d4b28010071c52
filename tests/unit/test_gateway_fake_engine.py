"""Tests of the fake engine client itself (``test_gateway_fake``): the gateway's tests rely on
it being deterministic and honouring the sampling parameters it claims to."""

from __future__ import annotations

from shoal.bus.messages.sampling import OutputKind, SamplingParams
from tests.unit.test_gateway_fake import FakeEngineClient


async def _collect(engine: FakeEngineClient, params: SamplingParams, prompt: str = "the fox"):
    return [out async for out in engine.generate(prompt, params, "r1")]


async def test_fake_is_deterministic_and_honours_max_tokens_and_n() -> None:
    engine = FakeEngineClient()
    params = SamplingParams(max_tokens=5, n=2, output_kind=OutputKind.DELTA)
    first, second = await _collect(engine, params), await _collect(engine, params)
    texts = ["".join(c.text for o in first for c in o.outputs if c.index == i) for i in range(2)]
    again = ["".join(c.text for o in second for c in o.outputs if c.index == i) for i in range(2)]
    assert texts == again and texts[0] != texts[1]
    assert all(len(t.split()) == 5 for t in texts)
    assert first[-1].finished and {c.finish_reason for c in first[-1].outputs} == {"length"}


async def test_fake_cumulative_equals_joined_deltas() -> None:
    engine = FakeEngineClient()
    delta = await _collect(engine, SamplingParams(max_tokens=6, output_kind=OutputKind.DELTA))
    cumulative = await _collect(engine, SamplingParams(max_tokens=6))
    final = await _collect(engine, SamplingParams(max_tokens=6, output_kind=OutputKind.FINAL_ONLY))
    joined = "".join(c.text for o in delta for c in o.outputs)
    assert joined == cumulative[-1].outputs[0].text == final[0].outputs[0].text
    assert len(final) == 1


async def test_fake_stops_on_stop_string_and_eos() -> None:
    engine = FakeEngineClient()
    full = (await _collect(engine, SamplingParams(max_tokens=8)))[-1].outputs[0].text
    stop = full.split()[3]
    params = SamplingParams(max_tokens=8, stop=[stop], output_kind=OutputKind.DELTA)
    outs = await _collect(engine, params)
    text = "".join(c.text for o in outs for c in o.outputs)
    assert text == full[: full.index(stop)]
    assert outs[-1].outputs[0].stop_reason == stop
    eos = FakeEngineClient(eos_after=2)
    last = (await _collect(eos, SamplingParams(max_tokens=8)))[-1].outputs[0]
    assert last.finish_reason == "stop" and len(last.token_ids) == 3


async def test_fake_records_abort_when_closed_early() -> None:
    engine = FakeEngineClient()
    stream = engine.generate("the fox", SamplingParams(max_tokens=50), "r-abort")
    await anext(stream)
    assert engine.in_flight == {"r-abort"}
    await stream.aclose()  # type: ignore[attr-defined]
    assert engine.in_flight == set() and engine.aborted == ["r-abort"]
