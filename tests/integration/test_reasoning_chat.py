"""Reasoning models through chat completions (``--reasoning-parser``) over the real engine
stack: a tiny model driven by a regex grammar to write ``<think>...</think>`` and an answer
gives ``reasoning_content`` and ``content`` split exactly, and the streamed deltas join to the
same split; with qwen3's parser an answer without thinking is all content. (The regex
constrains the thinking too here: ``structured_in_reasoning``, vLLM's ``enable_in_reasoning``.)"""

from __future__ import annotations

import re

import openai
import pytest

from tests.integration.served_stack import (
    CHAT_TEMPLATE,
    MODEL_NAME,
    served_stack,
    with_chat_template,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
THINKING = r"<think>[a-z]{3,8}( [a-z]{2,6}){1,2}</think>[a-z]{3,8}( [a-z]{2,6}){1,2}"
PLAIN = r"[a-z]{3,8}( [a-z]{2,6}){1,2}"
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]


async def answers(url: str, regex: str) -> tuple[dict, str, str]:  # type: ignore[type-arg]
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    common = {
        "model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 80, "temperature": 0,
        "extra_body": {"structured_outputs": {"regex": regex}},
    }  # fmt: skip
    whole = await client.chat.completions.create(**common)
    reasoning, content = "", ""
    async for chunk in await client.chat.completions.create(**common, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta.model_dump()
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
    return whole.choices[0].message.model_dump(), reasoning, content


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
async def test_thinking_is_split_from_the_answer_whole_and_streamed(
    tiny_checkpoint, tmp_path, parser
) -> None:  # type: ignore[no-untyped-def]
    model_dir = with_chat_template(tiny_checkpoint("llama"), tmp_path / "model")
    options = {"reasoning_parser": parser, "structured_in_reasoning": True}  # the regex drives
    async with served_stack(model_dir, app_options=options) as served:
        message, reasoning, content = await answers(served.url, THINKING)
        # the grammar wrote <think>WORDS</think>WORDS: each side of the tags, exactly
        assert re.fullmatch(PLAIN, message["reasoning_content"] or "") is not None, message
        assert re.fullmatch(PLAIN, message["content"] or "") is not None, message
        assert (reasoning, content) == (message["reasoning_content"], message["content"])
        if parser == "qwen3":  # no thinking written: all of it is the answer
            message, reasoning, content = await answers(served.url, PLAIN)
            assert message["reasoning_content"] is None and reasoning == ""
            assert re.fullmatch(PLAIN, message["content"]) and content == message["content"]
        await served.wait_until_idle()


async def test_anthropic_messages_give_thinking_blocks(tiny_checkpoint, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With a reasoning parser, /v1/messages answers the thinking as a ``thinking`` block
    before the text, whole and streamed (``thinking_delta``s joining to it)."""
    import anthropic

    model_dir = with_chat_template(tiny_checkpoint("llama"), tmp_path / "model")
    options = {"reasoning_parser": "deepseek_r1", "structured_in_reasoning": True}
    async with served_stack(model_dir, app_options=options) as served:
        client = anthropic.AsyncAnthropic(base_url=served.url, api_key="x", max_retries=0)
        common = {
            "model": MODEL_NAME, "max_tokens": 80, "messages": MESSAGES,
            "extra_body": {"temperature": 0, "structured_outputs": {"regex": THINKING}},
        }  # fmt: skip
        message = await client.messages.create(**common)
        assert [b.type for b in message.content] == ["thinking", "text"]
        assert re.fullmatch(PLAIN, message.content[0].thinking), message.content
        assert re.fullmatch(PLAIN, message.content[1].text), message.content
        thinking, text = "", ""
        async with client.messages.stream(**common) as stream:
            async for event in stream:
                if event.type == "content_block_delta" and event.delta.type == "thinking_delta":
                    thinking += event.delta.thinking
                elif event.type == "content_block_delta" and event.delta.type == "text_delta":
                    text += event.delta.text
        assert (thinking, text) == (message.content[0].thinking, message.content[1].text)
        await served.wait_until_idle()


async def test_responses_give_a_reasoning_item_and_count_its_tokens(
    tiny_checkpoint, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """With a reasoning parser, a response's output is a reasoning item then the message, its
    usage counts the thinking's tokens (some, not all), and the stream's events say the same."""
    from openai.types.responses import ResponseStreamEvent

    from tests.fixtures.api_schemas import check_schema

    model_dir = with_chat_template(tiny_checkpoint("llama"), tmp_path / "model")
    options = {"reasoning_parser": "deepseek_r1", "structured_in_reasoning": True}
    async with served_stack(model_dir, app_options=options) as served:
        client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0)
        common = {
            "model": MODEL_NAME, "input": "the quick brown fox", "max_output_tokens": 80,
            "temperature": 0, "extra_body": {"structured_outputs": {"regex": THINKING[7:]}},
        }  # fmt: skip
        response = await client.responses.create(**common)
        assert [item.type for item in response.output] == ["reasoning", "message"]
        thinking = response.output[0].content[0].text  # type: ignore[union-attr,index]
        assert re.fullmatch(PLAIN, thinking) and re.fullmatch(PLAIN, response.output_text)
        usage = response.usage
        assert usage is not None
        assert 0 < usage.output_tokens_details.reasoning_tokens < usage.output_tokens
        events = [e async for e in await client.responses.create(**common, stream=True)]
        for event in events:
            check_schema(ResponseStreamEvent, event.model_dump(mode="json", exclude_unset=True))
        closing = events[-1].response  # type: ignore[union-attr]
        assert closing.output_text == response.output_text
        assert closing.usage.output_tokens_details == usage.output_tokens_details
        await served.wait_until_idle()


# Qwen3's way to turn the thinking off: the template closes an empty one in the prompt.
THINKING_SWITCH_TEMPLATE = CHAT_TEMPLATE + (
    "{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}"
)


async def test_thinking_turned_off_by_the_template_leaves_all_answer(
    tiny_checkpoint, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """``chat_template_kwargs: {"enable_thinking": false}`` with a template that then closes the
    thinking in the prompt: the grammar applies from the first token (not after a thinking
    that will not come) and the whole output is content; with thinking on, the same request's
    grammar waits for a ``</think>`` first."""
    model_dir = with_chat_template(
        tiny_checkpoint("llama"), tmp_path / "model", THINKING_SWITCH_TEMPLATE
    )
    async with served_stack(model_dir, app_options={"reasoning_parser": "deepseek_r1"}) as served:
        client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0)
        common = {
            "model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 40, "temperature": 0,
            "extra_body": {"structured_outputs": {"regex": PLAIN}},
        }  # fmt: skip
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        answer = await client.chat.completions.create(
            **{**common, "extra_body": {**common["extra_body"], **off}}  # type: ignore[dict-item]
        )
        message = answer.choices[0].message.model_dump()
        assert message["reasoning_content"] is None
        assert re.fullmatch(PLAIN, message["content"]) is not None, message
        thinking_on = await client.chat.completions.create(**common)
        assert thinking_on.choices[0].message.model_dump()["reasoning_content"] is not None
        await served.wait_until_idle()
