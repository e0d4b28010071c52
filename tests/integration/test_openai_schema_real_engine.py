"""OpenAI schema conformance and the accepted inputs through the real engine (worker, engine
core, engine client; a tiny random Llama whose tokenizer adds BOS, in-memory bus): every body
and stream chunk fits OpenAI's schema, ``echo`` with ``max_tokens: 0`` returns the prompt with
the logprobs transformers computes for it, ``add_special_tokens`` goes both ways, and
``/tokenizer_info`` describes the served tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from tests.fixtures.openai_schema import CHAT, COMPLETIONS, post_checked
from tests.integration.served_stack import CHAT_TEMPLATE, served_stack
from tests.integration.test_openai_schema import check_every_shape

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
PROMPT = "the quick brown fox jumps over the lazy dog"


def _with_bos_and_chat_template(model_dir: Path, out_dir: Path) -> Path:
    """A copy of the model whose tokenizer adds BOS (``<s>``) and has a chat template."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    shutil.copytree(model_dir, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)]
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def _hf_prompt_logprobs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """transformers' log-probabilities after each prompt position: [len(ids), vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


async def test_schema_and_inputs_through_the_real_engine(tiny_checkpoint, tmp_path) -> None:  # type: ignore[no-untyped-def]
    model_dir = _with_bos_and_chat_template(tiny_checkpoint("llama"), tmp_path / "model")
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 3}
    async with served_stack(model_dir) as served:
        url, stack = served.url, served.stack
        await check_every_shape(url)
        async with aiohttp.ClientSession() as session:
            whole = await post_checked(session, url, COMPLETIONS, body)
            chunks = await post_checked(session, url, COMPLETIONS, {**body, "stream": True})
            bare = await post_checked(
                session, url, COMPLETIONS, {**body, "add_special_tokens": False}
            )
            odd = {"prompt": PROMPT, "max_tokens": 3.0, "n": None, "stream": None, "echo": None}
            odd_answer = await post_checked(session, url, COMPLETIONS, odd)
            function = {"role": "function", "name": "lookup", "content": "42"}
            chat = {"messages": [{"role": "user", "content": "hi"}, function], "max_tokens": 2}
            await post_checked(session, url, CHAT, chat)
            async with session.get(url + "/tokenizer_info") as response:
                info = await response.json()
        tokenizer = stack.client.tokenizer
        ids = tokenizer.encode(PROMPT)
    assert ids[0] == tokenizer.bos_token_id
    assert info["chat_template"] == CHAT_TEMPLATE and info["bos_token"] == "<s>"
    assert info["tokenizer_class"] == type(tokenizer).__name__ and "name_or_path" not in info
    (choice,) = whole["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert whole["usage"]["prompt_tokens"] == len(ids) == len(choice["logprobs"]["tokens"])
    assert whole["usage"]["completion_tokens"] == 0
    assert bare["usage"]["prompt_tokens"] == len(ids) - 1  # no BOS
    assert bare["choices"][0]["text"] == PROMPT
    assert chunks[0]["choices"][0]["logprobs"] == choice["logprobs"]
    assert odd_answer["usage"]["completion_tokens"] == 3 and len(odd_answer["choices"]) == 1

    expected = _hf_prompt_logprobs(model_dir, ids)
    logprobs = choice["logprobs"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for position in range(1, len(ids)):
        row = expected[position - 1]
        got = logprobs["token_logprobs"][position]
        assert got == pytest.approx(row[ids[position]].item(), abs=1e-3), position
        top = logprobs["top_logprobs"][position]
        assert max(top.values()) == pytest.approx(row.max().item(), abs=1e-3), position
