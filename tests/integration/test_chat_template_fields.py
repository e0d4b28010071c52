"""vLLM's chat-template fields through the openai client against the real engine stack (tiny
Llama, in-memory bus): what each field does to the prompt, read from the ``AddRequest`` the
engine core got (decoded back to text, and counted in ``usage.prompt_tokens``); the 400s of
vLLM's refusals, in OpenAI's error shape naming the field; ``--chat-template`` (a file, or the
template itself) in place of the tokenizer's; and a model with no chat template, which answers
chat with vLLM's 400 and completions as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from shoal.deploy.arguments import config_from_namespace
from shoal.deploy.cli import build_parser
from tests.integration.engine_inbox import EngineInbox, engine_inbox
from tests.integration.served_stack import ServedStack, served_stack, with_chat_template

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

# Every field shows in what it renders: documents, a template kwarg, the messages, the prompt.
FIELDS_TEMPLATE = (
    "{% for d in documents or [] %}doc {{ d['title'] }}: {{ d['text'] }}\n{% endfor %}"
    "{% if mood is defined %}mood: {{ mood }}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
HI = [{"role": "user", "content": "hi"}]
PREFILLED = [*HI, {"role": "assistant", "content": "The capital of"}]
VLLM_NO_TEMPLATE = (  # vLLM's words, as its users see them (vllm/renderers/hf.py)
    "As of transformers v4.44, default chat template is no longer allowed, so you must provide "
    "a chat template if the tokenizer does not define one."
)
VLLM_UNTRUSTED = (  # vLLM's OpenAIServing._validate_chat_template
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)


def _client(served: ServedStack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0)


async def _prompt_seen(
    served: ServedStack, inbox: EngineInbox, messages: list[dict[str, Any]], **extra: Any
) -> str:
    """Chat once; the prompt the engine core got, as text (checked against the usage)."""
    answer = await _client(served).chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=1,
        extra_body=extra,  # type: ignore[arg-type]
    )
    prompt_ids = inbox.last.prompt_token_ids
    assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt_ids)
    return str(served.stack.client.tokenizer.decode(prompt_ids, skip_special_tokens=False))


async def _refusal(served: ServedStack, messages: list[dict[str, Any]], **extra: Any) -> Any:
    """Chat once, expecting a 400; its error body (OpenAI's shape)."""
    with pytest.raises(openai.BadRequestError) as caught:
        await _client(served).chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=1,
            extra_body=extra,  # type: ignore[arg-type]
        )
    assert caught.value.status_code == 400
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error", body
    return body


async def test_each_field_shapes_the_prompt_the_engine_gets(tiny_checkpoint, tmp_path) -> None:  # type: ignore[no-untyped-def]
    model_dir = with_chat_template(tiny_checkpoint("llama"), tmp_path / "model", FIELDS_TEMPLATE)
    trusted = {"trust_request_chat_template": True}
    async with served_stack(model_dir, app_options=trusted) as served:
        async with engine_inbox(served.stack.client, "e0") as inbox:
            assert await _prompt_seen(served, inbox, HI) == "user: hi\nassistant:"
            closed = await _prompt_seen(served, inbox, HI, add_generation_prompt=False)
            assert closed == "user: hi\n"
            kwargs = await _prompt_seen(served, inbox, HI, chat_template_kwargs={"mood": "sunny"})
            assert kwargs == "mood: sunny\nuser: hi\nassistant:"
            documents = [{"title": "Paris", "text": "a city"}]
            with_docs = await _prompt_seen(served, inbox, HI, documents=documents)
            assert with_docs == "doc Paris: a city\nuser: hi\nassistant:"
            continued = await _prompt_seen(
                served, inbox, PREFILLED, add_generation_prompt=False, continue_final_message=True
            )
            assert continued == "user: hi\nassistant: The capital of"  # left open, no newline
            own = "OWN {{ messages[0]['content'] }}{% if add_generation_prompt %}>{% endif %}"
            assert await _prompt_seen(served, inbox, HI, chat_template=own) == "OWN hi>"
            # the request's fields win over the same names in chat_template_kwargs (vLLM's merge)
            merged = await _prompt_seen(
                served,
                inbox,
                HI,
                add_generation_prompt=False,
                chat_template_kwargs={"add_generation_prompt": True},
            )
            assert merged == "user: hi\n"
        await served.wait_until_idle()


async def test_vllm_refusals_are_400s_naming_the_field(tiny_checkpoint, tmp_path) -> None:  # type: ignore[no-untyped-def]
    model_dir = with_chat_template(tiny_checkpoint("llama"), tmp_path / "model", FIELDS_TEMPLATE)
    async with served_stack(model_dir, app_options={"trust_request_chat_template": True}) as served:
        both = await _refusal(
            served, PREFILLED, continue_final_message=True, add_generation_prompt=True
        )
        assert both["param"] == "continue_final_message"
        assert both["message"] == (
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
        not_assistant = await _refusal(
            served, HI, continue_final_message=True, add_generation_prompt=False
        )
        assert not_assistant["param"] == "continue_final_message"
        assert "last message is not from the assistant" in not_assistant["message"]
        for reserved in ("tokenize", "chat_template"):
            kwargs = await _refusal(served, HI, chat_template_kwargs={reserved: "x"})
            assert kwargs["param"] == "chat_template_kwargs"
            expected = f"Found unexpected chat template kwargs from request: {{'{reserved}'}}"
            assert kwargs["message"] == expected
        broken = await _refusal(served, HI, chat_template="{% for m in messages %}{{ m }}")
        assert broken["param"] == "chat_template" and "cannot apply" in broken["message"]
        raising = await _refusal(served, HI, chat_template="{{ raise_exception('no chat') }}")
        assert raising["param"] == "chat_template" and "no chat" in raising["message"]
        # none of these reached the engine core, which answers the next request
        ok = await _client(served).chat.completions.create(
            model="tiny",
            messages=HI,
            max_tokens=2,  # type: ignore[arg-type]
        )
        assert ok.usage is not None and ok.usage.completion_tokens == 2
        await served.wait_until_idle()
        assert served.num_started() == 1


@pytest.mark.parametrize("given_as", ["file", "inline"])
async def test_the_served_chat_template_replaces_the_tokenizers(  # type: ignore[no-untyped-def]
    tiny_checkpoint, tmp_path: Path, given_as: str
) -> None:
    model_dir = with_chat_template(tiny_checkpoint("llama"), tmp_path / "model", FIELDS_TEMPLATE)
    template = "SERVED {{ messages[0]['content'] }}{% if add_generation_prompt %}>{% endif %}"
    flag = template
    if given_as == "file":
        flag = str(tmp_path / "served.jinja")
        Path(flag).write_text(template)
    ns = build_parser().parse_args(["serve", str(model_dir), "--chat-template", flag])
    config = config_from_namespace(ns, str(model_dir))
    assert config.model_config.chat_template == template
    async with served_stack(model_dir, chat_template=config.model_config.chat_template) as served:
        async with engine_inbox(served.stack.client, "e0") as inbox:
            assert await _prompt_seen(served, inbox, HI) == "SERVED hi>"
        await served.wait_until_idle()


def test_a_chat_template_flag_naming_no_file_is_refused(tmp_path: Path) -> None:
    ns = build_parser().parse_args(["serve", str(tmp_path), "--chat-template", "missing.jinja"])
    with pytest.raises(ValueError, match=r"\(missing.jinja\) looks like a file path"):
        config_from_namespace(ns, str(tmp_path))


async def test_a_model_without_a_chat_template_answers_chat_with_vllms_400(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    async with served_stack(tiny_checkpoint("llama")) as served:  # its tokenizer has no template
        missing = await _refusal(served, HI)
        assert missing["message"] == VLLM_NO_TEMPLATE
        assert missing["param"] == "chat_template"
        untrusted = await _refusal(served, HI, chat_template="{{ messages }}")
        assert untrusted["message"] == VLLM_UNTRUSTED
        assert untrusted["param"] == "chat_template"
        completion = await _client(served).completions.create(
            model="tiny",
            prompt="the quick brown fox",
            max_tokens=3,
            extra_body={"ignore_eos": True},
        )
        assert completion.usage is not None and completion.usage.completion_tokens == 3
        await served.wait_until_idle()
