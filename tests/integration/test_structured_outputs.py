"""Structured outputs through the real engine (tiny random Llama; offline ``LLM`` on the
in-memory bus, and the gateway with the openai client): for hypothesis-generated JSON schemas
(objects, arrays, enums, bounded integers, string patterns, nested) and regexes, every output
of the random model parses and validates, greedy and sampled; free requests batched with them
keep transformers' greedy tokens; the same with async scheduling and n-gram speculative
decoding on; the OpenAI fields reach the engine streamed and not, and a bad schema is a 400.

Bounded schemas only: a random model under an unbounded grammar (a free string, unlimited
whitespace) may never close it. ``disable_any_whitespace`` keeps JSON output compact."""

from __future__ import annotations

import json
import re
import string
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal import LLM, SamplingParams
from shoal.bus.messages.structured import StructuredOutputsParams
from tests.fixtures.models import hf_greedy, make_prompts
from tests.integration.engine_stack import engine_stack
from tests.integration.served_stack import served_stack, with_chat_template

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
MAX_TOKENS = 400
FREE_TOKENS = 8
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
LOOPING_PROMPTS = [[40, 41, 42], [7] * 12, [17, 42, 99, 17, 42]]

LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.tuples(st.integers(-50, 50), st.integers(0, 60)).map(
        lambda lo_span: {
            "type": "integer",
            "minimum": lo_span[0],
            "maximum": lo_span[0] + lo_span[1],
        }
    ),
    st.lists(st.text(string.ascii_letters, min_size=1, max_size=4), min_size=1, max_size=3)
    .map(lambda values: sorted(set(values)))
    .map(lambda values: {"enum": values}),
    st.sampled_from(["^[a-z]{1,4}$", "^[0-9]{2}-[A-F]{1,2}$", "^(ab|cd)+x$"]).map(
        lambda pattern: {"type": "string", "pattern": pattern}
    ),
)


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": sorted(properties),
        "additionalProperties": False,
    }


SCHEMAS = st.recursive(
    LEAVES,
    lambda children: st.one_of(
        st.dictionaries(
            st.text(string.ascii_lowercase, min_size=1, max_size=3),
            children,
            min_size=1,
            max_size=3,
        ).map(_object),
        children.map(lambda items: {"type": "array", "items": items, "maxItems": 2}),
    ),
    max_leaves=5,
)
REGEXES = st.lists(
    st.tuples(st.sampled_from(["[a-c]", "[0-9]", "x", "(yo|ha)"]), st.integers(1, 3)),
    min_size=1,
    max_size=4,
).map(lambda parts: "".join(f"{atom}{{1,{n}}}" for atom, n in parts))
SAMPLING = st.sampled_from([{"temperature": 0.0}, {"temperature": 1.0, "seed": 11}])


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):  # type: ignore[no-untyped-def]
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def free_prompt_and_tokens(model_dir) -> tuple[list[int], list[int]]:  # type: ignore[no-untyped-def]
    prompt = make_prompts([12], seed=5)[0]
    return prompt, hf_greedy(model_dir, [prompt], FREE_TOKENS)[0]


@pytest.fixture(scope="module", params=["plain", "async+ngram"])
def llm(model_dir, request) -> Iterator[LLM]:  # type: ignore[no-untyped-def]
    extra: dict[str, Any] = {}
    if request.param == "async+ngram":
        extra = {"async_scheduling": True, "speculative_config": NGRAM}
    engine = LLM(str(model_dir), num_gpu_blocks_override=256, max_num_seqs=8, **extra)
    yield engine
    engine.shutdown()


def _run(
    llm: LLM, free: tuple[list[int], list[int]], constraint: StructuredOutputsParams, sampling
) -> str:  # type: ignore[no-untyped-def]
    """The constrained output's text, checking the free request batched with it."""
    prompt, expected = free
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=constraint, **sampling),
        SamplingParams(temperature=0, max_tokens=FREE_TOKENS, ignore_eos=True),
    ]
    prompts = [{"prompt_token_ids": [7, 8, 9, 10]}, {"prompt_token_ids": prompt}]
    constrained, unconstrained = llm.generate(prompts, params, use_tqdm=False)
    assert list(unconstrained.outputs[0].token_ids) == expected  # unchanged by the grammar
    output = constrained.outputs[0]
    assert output.finish_reason == "stop", (output.text, output.finish_reason)
    return output.text


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(schema=SCHEMAS, sampling=SAMPLING)
def test_every_output_parses_and_validates_against_its_schema(
    llm: LLM, free_prompt_and_tokens, schema: dict[str, Any], sampling: dict[str, Any]
) -> None:  # type: ignore[no-untyped-def]
    constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    text = _run(llm, free_prompt_and_tokens, constraint, sampling)
    jsonschema.validate(json.loads(text), schema)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(regex=REGEXES, sampling=SAMPLING)
def test_every_output_matches_its_regex(
    llm: LLM, free_prompt_and_tokens, regex: str, sampling: dict[str, Any]
) -> None:  # type: ignore[no-untyped-def]
    text = _run(llm, free_prompt_and_tokens, StructuredOutputsParams(regex=regex), sampling)
    assert re.fullmatch(regex, text), (regex, text)


def test_choice_json_object_and_grammar(llm: LLM, free_prompt_and_tokens) -> None:  # type: ignore[no-untyped-def]
    greedy = {"temperature": 0.0}
    choices = ["alpha", "beta", "gamma delta"]
    assert _run(llm, free_prompt_and_tokens, StructuredOutputsParams(choice=choices), greedy) in (
        choices
    )
    grammar = 'root ::= "(" [a-z]{1,3} ("," [a-z]{1,3}){0,2} ")"'
    text = _run(llm, free_prompt_and_tokens, StructuredOutputsParams(grammar=grammar), greedy)
    assert re.fullmatch(r"\([a-z]{1,3}(,[a-z]{1,3}){0,2}\)", text), text


async def test_the_openai_fields_reach_the_engine(model_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    schema = _object(
        {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 1, "maximum": 9}}
    )
    served_dir = with_chat_template(model_dir, tmp_path / "model")
    async with served_stack(served_dir) as served:
        client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "answer"}]
        response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
        chat = await client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            response_format=response_format,  # type: ignore[arg-type]
        )
        jsonschema.validate(json.loads(chat.choices[0].message.content or ""), schema)
        stream = await client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            response_format=response_format,
            stream=True,  # type: ignore[arg-type]
        )
        joined = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert joined == chat.choices[0].message.content
        completion = await client.completions.create(
            model="tiny",
            prompt="pick",
            max_tokens=20,
            temperature=0,
            extra_body={"structured_outputs": {"choice": ["left", "right"]}},
        )
        assert completion.choices[0].text in ("left", "right")
        guided = await client.completions.create(
            model="tiny",
            prompt="digits",
            max_tokens=20,
            temperature=0,
            extra_body={"guided_regex": "[0-9]{4}"},
        )
        assert re.fullmatch("[0-9]{4}", guided.choices[0].text)
        with pytest.raises(openai.BadRequestError, match="Unsupported type"):
            await client.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=5,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {"type": "objectx"}},
                },  # type: ignore[arg-type]
            )
        with pytest.raises(openai.BadRequestError, match="one output constraint"):
            await client.completions.create(
                model="tiny",
                prompt="x",
                max_tokens=5,
                extra_body={"guided_regex": "a", "structured_outputs": {"regex": "b"}},
            )


async def _grammar_run(bus_factory, model_dir, regex: str, options) -> tuple[list[str], Any]:  # type: ignore[no-untyped-def]
    bus = await bus_factory()
    params = SamplingParams(
        temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(regex=regex)
    )
    async with engine_stack(bus, model_dir, **options) as stack:
        texts = []
        for i, prompt in enumerate(LOOPING_PROMPTS):
            final = None
            async for output in stack.client.generate(prompt, params, f"r{i}"):
                final = output
            assert final is not None and final.outputs[0].finish_reason == "stop"
            texts.append(final.outputs[0].text)
        return texts, stack.engines[0].core.scheduler.spec  # type: ignore[union-attr]


@pytest.mark.parametrize("regex", [r"[a-z ]{1,40}", r"[^\n]{1,40}"])
async def test_grammar_requests_verify_the_drafts_their_grammar_accepts(
    bus_factory, markov_checkpoint, regex: str
) -> None:  # type: ignore[no-untyped-def]
    """The markov model's outputs loop, so n-gram drafts come; each verified draft is one the
    grammar accepts (a wrong mask row per draft position would let the output leave it)."""
    plain, _ = await _grammar_run(bus_factory, markov_checkpoint, regex, {})
    spec_options = {"speculative_config": NGRAM}
    drafted, spec = await _grammar_run(bus_factory, markov_checkpoint, regex, spec_options)
    assert drafted == plain
    assert all(re.fullmatch(regex, text) for text in drafted), drafted
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens > 0
