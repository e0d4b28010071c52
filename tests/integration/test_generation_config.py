"""``--generation-config`` against the real engine stack (tiny Llama whose
``generation_config.json`` recommends greedy decoding and 5 new tokens): a request that leaves
those fields unset is run with them (the ``AddRequest`` the engine core got, and an output
equal to transformers' greedy one), a request that sets them keeps its own; completions keep
vLLM's 16 unless ``max_tokens`` is null; ``vllm`` ignores the file; a named directory is read
instead of the model's and bounds every request's ``max_tokens``; the NATS API and the offline
``LLM`` follow the same defaults; the defaults in force are logged once at start."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import openai
import pytest

from shoal import LLM, SamplingParams
from shoal.gateway.nats_api import NatsApi
from shoal.gateway.serving import serving_context
from tests.fixtures.models import hf_greedy
from tests.integration.engine_inbox import EngineInbox, engine_inbox
from tests.integration.served_stack import ServedStack, served_stack, with_chat_template

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
GREEDY_5 = {"temperature": 0, "max_new_tokens": 5}
HI = [{"role": "user", "content": "the quick brown fox"}]
NO_EOS = {"ignore_eos": True}  # the run's length is max_tokens, whatever the random model says


def with_generation_config(model_dir: Path, out_dir: Path, **fields: Any) -> Path:
    """A copy of ``model_dir`` whose ``generation_config.json`` also holds ``fields``."""
    shutil.copytree(model_dir, out_dir)
    path = out_dir / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return out_dir


@pytest.fixture
def chat_model(tiny_checkpoint, tmp_path: Path) -> Path:  # type: ignore[no-untyped-def]
    """The tiny Llama with a chat template (and the generation config it ships: no sampling)."""
    return with_chat_template(tiny_checkpoint("llama"), tmp_path / "chat")


def _client(served: ServedStack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0)


async def _chat(served: ServedStack, **fields: Any) -> Any:
    return await _client(served).chat.completions.create(
        model="tiny",
        messages=HI,
        extra_body=NO_EOS,
        **fields,  # type: ignore[arg-type]
    )


def _ran_with(inbox: EngineInbox) -> tuple[float, int | None]:
    params = inbox.last.sampling_params
    return params.temperature, params.max_tokens


async def test_unset_fields_take_the_models_generation_config(  # type: ignore[no-untyped-def]
    chat_model, tmp_path, caplog
) -> None:
    model_dir = with_generation_config(chat_model, tmp_path / "greedy", **GREEDY_5)
    with caplog.at_level(logging.WARNING, logger="shoal.engine.client.engine_client"):
        async with (
            served_stack(model_dir) as served,
            engine_inbox(served.stack.client, "e0") as inbox,
        ):
            chat = await _chat(served)
            assert _ran_with(inbox) == (0.0, 5)
            prompt_ids = inbox.last.prompt_token_ids
            assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"
            greedy = hf_greedy(model_dir, [prompt_ids], 5)[0]
            text = served.stack.client.tokenizer.decode(greedy, skip_special_tokens=True)
            assert chat.choices[0].message.content == text
            own = await _chat(served, temperature=1.0, max_tokens=3)
            assert _ran_with(inbox) == (1.0, 3) and own.usage.completion_tokens == 3
            plain = await _client(served).completions.create(
                model="tiny", prompt="the quick brown fox", extra_body=NO_EOS
            )
            assert _ran_with(inbox) == (0.0, 16)  # vLLM's completions default 16 stays
            assert plain.usage.completion_tokens == 16
            unset = await _client(served).completions.create(
                model="tiny", prompt="the quick brown fox", max_tokens=None, extra_body=NO_EOS
            )
            assert _ran_with(inbox) == (0.0, 5) and unset.usage.completion_tokens == 5
            nats = NatsApi(served.stack.client.bus, serving_context(served.stack.client))
            await nats.start()
            try:
                answer = await _ask_nats(nats, {"prompt": "the fox", "sampling_params": NO_EOS})
                assert _ran_with(inbox) == (0.0, 16)
                assert len(answer["choices"][0]["token_ids"]) == 16
                own_params = {**NO_EOS, "temperature": 0.5, "max_tokens": None}
                await _ask_nats(nats, {"prompt": "the fox", "sampling_params": own_params})
                assert _ran_with(inbox) == (0.5, 5)
            finally:
                await nats.stop()
            await served.wait_until_idle()
    logged = [r.getMessage() for r in caplog.records if "generation config" in r.getMessage()]
    assert len(logged) == 1 and "'temperature': 0.0" in logged[0] and "'max_tokens': 5" in logged[0]


async def _ask_nats(api: NatsApi, request: dict[str, Any]) -> Any:
    reply = await api.bus.request(
        api.subjects.api_generate(), json.dumps(request).encode(), timeout=30
    )
    answer = json.loads(reply.data)
    assert answer["type"] == "result", answer
    return answer


async def test_vllm_ignores_the_file(chat_model, tmp_path) -> None:  # type: ignore[no-untyped-def]
    model_dir = with_generation_config(chat_model, tmp_path / "greedy", **GREEDY_5)
    async with served_stack(model_dir, generation_config="vllm") as served:
        async with engine_inbox(served.stack.client, "e0") as inbox:
            await _chat(served, max_tokens=2)
            assert _ran_with(inbox) == (1.0, 2)  # SamplingParams' default temperature
            prompt_len = len(inbox.last.prompt_token_ids)
            await _chat(served, temperature=0, max_completion_tokens=None)
            assert _ran_with(inbox) == (0.0, served.stack.client.max_model_len - prompt_len)
        await served.wait_until_idle()


async def test_a_named_directory_is_read_and_bounds_max_tokens(chat_model, tmp_path) -> None:  # type: ignore[no-untyped-def]
    named = with_generation_config(chat_model, tmp_path / "named", **GREEDY_5)
    async with served_stack(chat_model, generation_config=str(named)) as served:
        async with engine_inbox(served.stack.client, "e0") as inbox:
            chat = await _chat(served)
            assert _ran_with(inbox) == (0.0, 5) and chat.usage.completion_tokens == 5
            plain = await _client(served).completions.create(
                model="tiny", prompt="the quick brown fox", max_tokens=12, extra_body=NO_EOS
            )
            assert _ran_with(inbox) == (0.0, 5)  # vLLM's override_max_tokens
            assert plain.usage.completion_tokens == 5
        await served.wait_until_idle()


def test_offline_generate_without_sampling_params_uses_them(tiny_checkpoint, tmp_path) -> None:  # type: ignore[no-untyped-def]
    model_dir = with_generation_config(tiny_checkpoint("llama"), tmp_path / "greedy", **GREEDY_5)
    prompt = [5, 6, 7, 8]
    with LLM(str(model_dir), num_gpu_blocks_override=64) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
        out = llm.generate({"prompt_token_ids": prompt}, use_tqdm=False)[0].outputs[0]
        given = SamplingParams(max_tokens=3, seed=1)
        sampled = llm.generate({"prompt_token_ids": prompt}, given, use_tqdm=False)[0].outputs[0]
    expected = hf_greedy(model_dir, [prompt], 5)[0]
    stop = expected.index(2) + 1 if 2 in expected else 5  # the model's EOS may end it early
    assert out.token_ids == expected[:stop]
    assert len(sampled.token_ids) <= 3  # given parameters are taken as they are
    with LLM(str(model_dir), num_gpu_blocks_override=64, generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
