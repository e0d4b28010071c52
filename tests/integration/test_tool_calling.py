"""Tool calling through the official openai client over the real engine stack (tiny random Llama,
in-memory bus, a chat template that renders tools and tool calls).

``required`` and a named function are enforced with a grammar, so even the random model always
yields valid calls: their arguments parse and validate against the tool's schema (the schemas
are bounded: enums, bounded integers, patterns), streamed deltas join to the same calls.
``auto`` is tested through the real gateway and engine with the output forced into each
parser's format by a ``structured_outputs`` regex (the random model would never write one):
the gateway's parser, with the server's ``--tool-call-parser``, finds the calls, streamed and
not. ``none`` leaves plain content; mistakes are 400s naming the field."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from shoal.engine.client.chat_options import ChatOptions
from shoal.gateway.tools import ToolCallingOptions
from tests.integration.served_stack import served_stack, with_chat_template

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
MAX_TOKENS = 300
TEMPLATE = (  # tools by name only: the tiny tokenizer spends a token or two per character
    "{% for t in tools or [] %}<s>tool {{ t['type'] }} {{ t['function']['name'] }}\n{% endfor %}"
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %} call {{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [
    {"type": "function", "function": {"name": name, "description": "d", "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
MESSAGES = [{"role": "user", "content": "what is the weather?"}]


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint, tmp_path_factory):  # type: ignore[no-untyped-def]
    return with_chat_template(
        tiny_checkpoint("llama"), tmp_path_factory.mktemp("tools") / "model", TEMPLATE
    )


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def _valid_calls(calls: Any) -> list[tuple[str, str]]:
    """(name, arguments) of each call, checked: a known tool, arguments valid for it."""
    assert calls, "no tool calls"
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        out.append((call.function.name, call.function.arguments))
    return out


async def _streamed(client: openai.AsyncOpenAI, **kwargs: Any) -> tuple[dict[int, Any], Any]:
    """Calls joined from a stream's deltas (by index: id, name, arguments), and the finish."""
    calls: dict[int, dict[str, Any]] = {}
    finish, content = None, ""
    stream = await client.chat.completions.create(stream=True, **kwargs)
    async for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:  # the first delta: id, type and name
                assert delta.id and delta.type == "function" and delta.function.name
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "args": ""}
            else:
                assert delta.id is None
            calls[delta.index]["args"] += delta.function.arguments or ""
    return calls, (finish, content)


async def test_required_and_named_choices_always_give_valid_calls(model_dir) -> None:  # type: ignore[no-untyped-def]
    async with served_stack(model_dir) as served:
        client = _client(served.url)
        common = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": MAX_TOKENS}
        for seed in range(6):  # one call at most: an array a random model always closes
            answer = await client.chat.completions.create(
                **common, tool_choice="required", temperature=1, seed=seed,
                parallel_tool_calls=False,
            )  # fmt: skip
            choice = answer.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            assert choice.message.content is None
            assert len(_valid_calls(choice.message.tool_calls)) == 1
        one = {"tool_choice": "required", "temperature": 0, "parallel_tool_calls": False}
        greedy = await client.chat.completions.create(**common, **one)
        calls, (finish, content) = await _streamed(client, **common, **one)
        assert finish == "tool_calls" and content == ""
        streamed = [(calls[i]["name"], calls[i]["args"]) for i in sorted(calls)]
        assert streamed == _valid_calls(greedy.choices[0].message.tool_calls)

        named = {"type": "function", "function": {"name": "get_time"}}
        for sampling in ({"temperature": 0}, {"temperature": 1, "seed": 3}):
            answer = await client.chat.completions.create(**common, tool_choice=named, **sampling)
            choice = answer.choices[0]
            assert [name for name, _ in _valid_calls(choice.message.tool_calls)] == ["get_time"]
            assert choice.finish_reason == "stop" and choice.message.content is None
        whole = await client.chat.completions.create(**common, tool_choice=named, temperature=0)
        calls, (finish, _) = await _streamed(client, **common, tool_choice=named, temperature=0)
        assert finish == "stop"
        assert [(c["name"], c["args"]) for c in calls.values()] == _valid_calls(
            whole.choices[0].message.tool_calls
        )
        await served.wait_until_idle()


async def test_none_renders_tools_and_answers_plain_content(model_dir) -> None:  # type: ignore[no-untyped-def]
    async with served_stack(model_dir) as served:
        client = _client(served.url)
        common = {"model": "tiny", "max_tokens": 5, "temperature": 0}
        answer = await client.chat.completions.create(
            **common, messages=MESSAGES, tools=TOOLS, tool_choice="none"
        )
        choice = answer.choices[0]
        assert choice.message.content and not choice.message.tool_calls
        assert choice.finish_reason == "length"
        encode = served.stack.client.encode_chat
        with_tools = encode(MESSAGES, ChatOptions(tools=TOOLS))
        assert answer.usage.prompt_tokens == len(with_tools) > len(encode(MESSAGES))
        call = {"id": "c1", "type": "function"}
        call["function"] = {"name": "get_time", "arguments": '{"zone": "UTC"}'}
        conversation = [
            *MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "noon"},
        ]
        follow_up = await client.chat.completions.create(
            **common, messages=conversation, tools=TOOLS, tool_choice="none"
        )
        rendered = [
            MESSAGES[0],
            {"role": "assistant", "content": "", "tool_calls": [
                {**call, "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}
            ]},
            {"role": "tool", "content": "noon", "tool_call_id": "c1"},
        ]  # fmt: skip
        assert follow_up.usage.prompt_tokens == len(encode(rendered, ChatOptions(tools=TOOLS)))
        await served.wait_until_idle()


async def _refused(client: openai.AsyncOpenAI, param: str, **kwargs: Any) -> str:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model="tiny", messages=MESSAGES, **kwargs)
    body = caught.value.body
    assert isinstance(body, dict) and body.get("param") == param, body
    return str(body.get("message"))


async def test_tool_mistakes_are_400s_naming_the_field(model_dir) -> None:  # type: ignore[no-untyped-def]
    async with served_stack(model_dir) as served:
        client = _client(served.url)
        message = await _refused(client, "tool_choice", tools=TOOLS)  # auto by default
        assert "--enable-auto-tool-choice" in message
        await _refused(client, "tool_choice", tools=TOOLS, tool_choice="auto")
        unknown = {"type": "function", "function": {"name": "nope"}}
        assert "nope" in await _refused(client, "tool_choice", tools=TOOLS, tool_choice=unknown)
        await _refused(client, "tool_choice", tool_choice="required")  # no tools
        await _refused(client, "tool_choice", tools=TOOLS, tool_choice="sometimes")
        await _refused(
            client, "tools[0].function", tools=[{"type": "function"}], tool_choice="none"
        )
        await _refused(client, "tools", tools=[{"function": {"name": 1}}], tool_choice="none")
        await _refused(
            client,
            "tool_choice",
            tools=TOOLS,
            tool_choice="required",
            response_format={"type": "json_object"},
        )
        bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objx"}}}]
        await _refused(client, "tools", tools=bad, tool_choice="required")
        await served.wait_until_idle()


# The output each parser's format forces (a regex), with the content before the calls.
FORCED = {
    "hermes": (
        'ok <tool_call>\\{"name": "get_weather", "arguments": \\{"city": "(Paris|Rome)", "days": '
        '[1-7]\\}\\}</tool_call>\n<tool_call>\\{"name": "get_time", "arguments": \\{"zone": '
        '"[A-Z]{3}"\\}\\}</tool_call>'
    ),
    "llama3_json": (
        '\\{"name": "get_weather", "parameters": \\{"city": "(Paris|Rome)", "days": [1-7]\\}\\}; '
        '\\{"name": "get_time", "parameters": \\{"zone": "[A-Z]{3}"\\}\\}'
    ),
    "mistral": (
        'ok \\[TOOL_CALLS\\] \\[\\{"name": "get_weather", "arguments": \\{"city": "(Paris|Rome)", '
        '"days": [1-7]\\}\\}, \\{"name": "get_time", "arguments": \\{"zone": "[A-Z]{3}"\\}\\}\\]'
    ),
}


HELD = {
    "hermes": "no call <tool_c",
    "llama3_json": "no call <\\|python",
    "mistral": "no call \\[TOOL",
}


@pytest.mark.parametrize("parser", sorted(FORCED))
async def test_auto_parses_the_parsers_format(model_dir, parser: str) -> None:  # type: ignore[no-untyped-def]
    options = {"tool_calling": ToolCallingOptions(True, parser)}
    async with served_stack(model_dir, app_options=options) as served:
        client = _client(served.url)
        common = {
            "model": "tiny",
            "messages": MESSAGES,
            "tools": TOOLS,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "extra_body": {"structured_outputs": {"regex": FORCED[parser]}},
        }
        answer = await client.chat.completions.create(**common)  # tool_choice: auto
        choice = answer.choices[0]
        calls = _valid_calls(choice.message.tool_calls)
        assert [name for name, _ in calls] == ["get_weather", "get_time"]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == (None if parser == "llama3_json" else "ok ")
        streamed, (finish, content) = await _streamed(client, **common)
        assert [(c["name"], c["args"]) for c in streamed.values()] == calls
        assert finish == "tool_calls" and content == (choice.message.content or "")
        # No call, ending in what may be the start of a tag: held back, then sent as content.
        held = {**common, "extra_body": {"structured_outputs": {"regex": HELD[parser]}}}
        answer = await client.chat.completions.create(**held)
        choice = answer.choices[0]
        assert not choice.message.tool_calls and choice.finish_reason == "stop"
        assert choice.message.content == "no call " + HELD[parser][8:].replace("\\", "")
        streamed, (finish, content) = await _streamed(client, **held)
        assert not streamed and finish == "stop" and content == choice.message.content
        plain = await client.chat.completions.create(**{**common, "tool_choice": "none"})
        assert not plain.choices[0].message.tool_calls  # the same text, left as content
        assert "get_time" in (plain.choices[0].message.content or "")
        assert plain.choices[0].finish_reason == "stop"
        await served.wait_until_idle()
