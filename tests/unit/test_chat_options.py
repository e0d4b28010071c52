"""vLLM's chat-template rules, without a model: how the request's fields and
``chat_template_kwargs`` merge, what is refused (with the field named), and vLLM's error for a
tokenizer without a template."""

from __future__ import annotations

import pytest

from shoal.engine.client.chat_options import ChatOptions, check_chat_options
from shoal.engine.client.interface import RequestValidationError
from shoal.engine.client.tokenizer import MISSING_CHAT_TEMPLATE, MissingChatTemplateError, Tokenizer
from tests.unit.test_gateway_fake import fake_tokenizer

USER = {"role": "user", "content": "hi"}
ASSISTANT = {"role": "assistant", "content": "The"}


def test_the_requests_fields_win_over_the_same_template_kwargs() -> None:
    kwargs = {"add_generation_prompt": True, "documents": ["kept"], "mood": "calm"}
    options = ChatOptions(add_generation_prompt=False, chat_template_kwargs=kwargs)
    assert options.render_kwargs() == {
        "add_generation_prompt": False,
        "continue_final_message": False,
        "documents": ["kept"],  # the request's documents are unset: the kwarg stays
        "mood": "calm",
    }
    docs = [{"title": "t", "text": "x"}]
    given = ChatOptions(documents=docs, tools=[{"type": "function"}], chat_template_kwargs=kwargs)
    assert given.render_kwargs()["documents"] == docs
    assert given.render_kwargs()["tools"] == [{"type": "function"}]
    assert "tools" not in ChatOptions(tools=[]).render_kwargs()  # no tools: none passed


@pytest.mark.parametrize(
    ("options", "messages", "param", "message"),
    [
        (
            ChatOptions(continue_final_message=True),
            [USER, ASSISTANT],
            "continue_final_message",
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
        ),
        (
            ChatOptions(add_generation_prompt=False, continue_final_message=True),
            [USER],
            "continue_final_message",
            "Cannot set `continue_final_message` to True when the last message is not from the "
            "assistant.",
        ),
        (
            ChatOptions(chat_template_kwargs={"tokenize": True, "chat_template": "x"}),
            [USER],
            "chat_template_kwargs",
            "Found unexpected chat template kwargs from request: {'chat_template', 'tokenize'}",
        ),
    ],
)
def test_vllms_refusals_name_the_field(
    options: ChatOptions, messages: list[dict[str, str]], param: str, message: str
) -> None:
    with pytest.raises(RequestValidationError) as caught:
        check_chat_options(options, messages)
    assert (caught.value.param, str(caught.value)) == (param, message)


def test_continuing_an_assistant_message_is_allowed() -> None:
    check_chat_options(
        ChatOptions(add_generation_prompt=False, continue_final_message=True), [USER, ASSISTANT]
    )
    check_chat_options(ChatOptions(chat_template_kwargs={"enable_thinking": False}), [USER])


def test_a_tokenizer_without_a_template_raises_vllms_error() -> None:
    bare = Tokenizer(fake_tokenizer())  # the shared fake, its template taken away meanwhile
    bare.hf.chat_template, template = None, bare.hf.chat_template
    try:
        with pytest.raises(MissingChatTemplateError) as caught:
            bare.apply_chat_template([USER])
        assert isinstance(caught.value, RequestValidationError)
        assert (str(caught.value), caught.value.param) == (MISSING_CHAT_TEMPLATE, "chat_template")
        own = ChatOptions(chat_template="{{ messages[0]['content'] }}!")
        assert bare.apply_chat_template([USER], own) == "hi!"  # a request's own still renders
    finally:
        bare.hf.chat_template = template
