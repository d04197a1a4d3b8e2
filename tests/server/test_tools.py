"""Tool calling: the hermes parser, the prompt's tools, and a tool loop through the official
openai client against a real server on the embedded model."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from kvtier.errors import KvtierError
from kvtier.models.tool_parsers import TOOL_PARSERS, ToolCall
from kvtier.server.tool_replies import ToolStream
from kvtier.server.tools import ToolTurn
from kvtier.settings.server import ServerConfig
from tests.server.conftest import ALICE_KEY, MODEL, wait_idle

HERMES = TOOL_PARSERS["hermes"]
BLOCK_TOKENS = 16
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
FORCE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
# On these messages the embedded model, forced to call get_weather, writes valid JSON.
QUESTION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What's the weather in Tokyo?"},
]
# ... and repeats a call it is shown, which tool_choice "auto" reads and "none" does not.
REPEAT_CALL = (
    'Repeat exactly: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call>"
)


def turn(tools=(WEATHER,), reads_calls=True, reply_start="", first_call_only=False) -> ToolTurn:
    return ToolTurn(list(tools), HERMES, reads_calls, reply_start, first_call_only)


# -- the hermes parser, on handwritten replies


def test_parser_reads_one_call_with_its_arguments_as_written():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'
    parsed = HERMES.parse(text)
    assert parsed.content is None
    assert parsed.tool_calls == [ToolCall("get_weather", '{"city":"Paris"}')]


def test_parser_reads_two_calls_and_the_text_before_them():
    text = (
        "Let me check both.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    parsed = HERMES.parse(text)
    assert parsed.content == "Let me check both."
    assert [c.name for c in parsed.tool_calls] == ["get_weather", "get_time"]
    assert [json.loads(c.arguments) for c in parsed.tool_calls] == [{"city": "Paris"}, {}]


def test_parser_reads_smollm2_model_card_list_and_an_unclosed_last_call():
    listed = '<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b"}]</tool_call>'
    assert HERMES.parse(listed).tool_calls == [ToolCall("a", '{"x": 1}'), ToolCall("b", "{}")]
    unclosed = '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n'
    assert HERMES.parse(unclosed).tool_calls == [ToolCall("a", '{"x": 1}')]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": </tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "a", "arguments": [1, 2]}</tool_call>',
        "<tool_call>",
    ],
)
def test_a_malformed_call_leaves_the_whole_reply_as_text(text):
    parsed = HERMES.parse(text)
    assert parsed.content == text and parsed.tool_calls == []


def test_a_call_written_back_is_read_as_the_same_call():
    call = ToolCall("get_weather", '{"city": "Paris"}')
    text = HERMES.call_text(call)
    assert text.startswith(HERMES.forced_start("get_weather"))
    assert HERMES.parse(text).tool_calls == [call]


def test_turn_reads_calls_of_offered_tools_only_and_honours_parallel_false():
    two = HERMES.call_text(ToolCall("get_weather", "{}")) + HERMES.call_text(
        ToolCall("get_time", "{}")
    )
    assert turn(tools=(WEATHER,)).read(two).tool_calls == []  # get_time is not offered
    assert len(turn(tools=(WEATHER, TIME)).read(two).tool_calls) == 2
    assert len(turn(tools=(WEATHER, TIME), first_call_only=True).read(two).tool_calls) == 1
    assert turn(reads_calls=False).read(two).content == two


# -- a stream holds back what may be a call


def feed_by_char(stream: ToolStream, text: str) -> str:
    return "".join(stream.feed(ch) for ch in text)


def test_stream_sends_text_before_a_call_and_the_call_at_the_end():
    call = HERMES.call_text(ToolCall("get_weather", '{"city": "Paris"}'))
    stream = ToolStream(turn())
    sent = feed_by_char(stream, "Checking. " + call)
    assert sent == "Checking. "  # not a character of the call
    text, calls, finish = stream.finish("stop")
    assert (text, finish) == ("", "tool_calls")
    assert calls[0]["index"] == 0 and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_stream_of_plain_text_sends_it_all_even_a_lone_angle_bracket():
    stream = ToolStream(turn())
    sent = feed_by_char(stream, "a < b and <tool")
    assert sent == "a < b and "  # "<tool" may still become a call
    text, calls, finish = stream.finish("length")
    assert (sent + text, calls, finish) == ("a < b and <tool", [], "length")


def test_stream_of_a_malformed_forced_call_sends_its_opening_and_text_at_the_end():
    start = HERMES.forced_start("get_weather")
    stream = ToolStream(turn(reply_start=start))
    assert feed_by_char(stream, " {oops") == ""
    assert stream.finish("stop") == (start + " {oops", [], "stop")


# -- the prompt


def test_fallback_prompt_lists_tools_in_the_system_message_and_writes_calls_back(tokenizer):
    from kvtier.models.tokenizer import chat_token_ids

    messages = [
        *QUESTION,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, clear"},
    ]
    text = tokenizer.decode(chat_token_ids(tokenizer, messages, [WEATHER]))
    system = text[: text.index("<|im_end|>")]
    assert system.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools")
    assert f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in system
    assert (
        "<|im_start|>assistant\n"
        + HERMES.call_text(ToolCall("get_weather", '{"city": "Tokyo"}'))
        + "<|im_end|>\n<|im_start|>tool\n<tool_response>\n21 C, clear\n</tool_response><|im_end|>"
    ) in text


def test_next_turns_prompt_starts_with_this_prompt_and_its_forced_reply(tokenizer):
    """The prefix cache keys KV by tokens: the tool loop's next prompt must begin with the
    tokens of this prompt (the forced call's opening included) and of the reply."""
    from kvtier.models.tokenizer import chat_token_ids

    start = HERMES.forced_start("get_weather")
    first = chat_token_ids(tokenizer, QUESTION, [WEATHER], start)
    reply = ' {"city": "Tokyo"}}\n</tool_call>'  # what the model writes after the opening
    arguments = HERMES.parse(start + reply).tool_calls[0].arguments
    call = {
        "id": "c",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    messages = [
        *QUESTION,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "21 C"},
    ]
    second = chat_token_ids(tokenizer, messages, [WEATHER])
    reply_ids = tokenizer.encode(reply, add_special_tokens=False)
    assert second[: len(first) + len(reply_ids)] == first + reply_ids


def test_a_template_that_takes_tools_gets_them_and_arguments_as_a_mapping(model_dir):
    from kvtier.models.tokenizer import chat_token_ids, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    tokenizer.chat_template = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}call {{ c.function.arguments.city }}{% endfor %};"
        "{% endfor %}"
    )
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"city": "X"}'}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    text = tokenizer.decode(chat_token_ids(tokenizer, messages, [WEATHER]))
    assert text == "[get_weather]user:hi;assistant:call X;"


def test_tool_call_parser_setting_names_a_known_parser():
    assert ServerConfig().tool_call_parser == "hermes"
    with pytest.raises(KvtierError, match="tool_call_parser must be hermes"):
        ServerConfig(tool_call_parser="mistral")


# -- through the server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1, api_key=ALICE_KEY, max_retries=0, timeout=120)


def ask(client, messages, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=64, **kwargs
    )


@pytest.mark.slow
def test_tool_loop_with_a_named_function(client, engine):
    headers = {"X-Session-ID": "tool-loop"}
    messages = list(QUESTION)
    first = ask(client, messages, tools=[WEATHER], tool_choice=FORCE_WEATHER, extra_headers=headers)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert isinstance(call.function.arguments, str)
    assert isinstance(json.loads(call.function.arguments), dict)
    # the engine was told how the turn ended, for the retention policy
    record = engine.sessions.turns("alice/tool-loop")[-1]
    assert (record.end, record.tool) == ("tool_call", "get_weather")

    messages.append(choice.message.model_dump(exclude_none=True))
    result = {"city": "Tokyo", "temperature_c": 21, "sky": "clear"}
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    second = ask(client, messages, tools=[WEATHER], extra_headers=headers)
    assert second.choices[0].message.content
    assert not second.choices[0].message.tool_calls
    assert second.choices[0].finish_reason in ("stop", "length")
    # The second prompt starts with the first prompt and its reply: every full block of
    # them (the reply's last token never had its KV computed) comes from the cache.
    shared = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= shared // BLOCK_TOKENS * BLOCK_TOKENS > first.usage.prompt_tokens
    wait_idle(engine)


@pytest.mark.slow
def test_streamed_tool_calls_reassemble_to_the_unstreamed_ones(client):
    kwargs = dict(tools=[WEATHER], tool_choice=FORCE_WEATHER)
    whole = ask(client, QUESTION, **kwargs).choices[0]
    assert whole.finish_reason == "tool_calls"
    chunks = list(ask(client, QUESTION, stream=True, **kwargs))
    calls: dict[int, dict] = {}
    content = ""
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or ():
            call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = part.id or call["id"]
            call["name"] += part.function.name or ""
            call["arguments"] += part.function.arguments or ""
    finals = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finals == ["tool_calls"]
    assert content == ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert calls[0]["id"].startswith("call_")


@pytest.mark.slow
def test_tool_choice_none_answers_in_text_what_auto_reads_as_a_call(client):
    messages = [{"role": "user", "content": REPEAT_CALL}]
    auto = ask(client, messages, tools=[WEATHER], tool_choice="auto").choices[0]
    assert auto.finish_reason == "tool_calls"
    assert [
        (c.function.name, json.loads(c.function.arguments)) for c in auto.message.tool_calls
    ] == [("get_weather", {"city": "Paris"})]
    none = ask(client, messages, tools=[WEATHER], tool_choice="none").choices[0]
    assert none.message.tool_calls is None and none.finish_reason == "stop"
    assert "<tool_call>" in none.message.content
    streamed = list(ask(client, messages, tools=[WEATHER], tool_choice="none", stream=True))
    assert not any(c.choices[0].delta.tool_calls for c in streamed)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == none.message.content


@pytest.mark.slow
def test_required_lets_the_model_name_the_tool_and_an_unusable_call_is_text(client):
    """With two tools, "required" forces a call but not its name; the 135M model invents
    one here, and a call of a tool not offered comes back as the text it wrote."""
    choice = ask(client, QUESTION, tools=[WEATHER, TIME], tool_choice="required").choices[0]
    if choice.finish_reason == "tool_calls":
        assert {c.function.name for c in choice.message.tool_calls} <= {"get_weather", "get_time"}
    else:
        assert choice.message.tool_calls is None
        assert choice.message.content.startswith(HERMES.forced_start(None))


@pytest.mark.slow
def test_a_forced_call_that_does_not_parse_is_answered_as_text(client, engine):
    """Forcing is by prompt, not constrained decoding: on this question the embedded model
    closes the call's JSON and writes on, so the reply is text, opening included. The session
    still waits on the tool it was forced to call."""
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    headers = {"X-Session-ID": "forced"}
    for stream in (False, True):
        resp = ask(
            client,
            messages,
            tools=[WEATHER],
            tool_choice=FORCE_WEATHER,
            stream=stream,
            extra_headers=headers,
        )
        if stream:
            chunks = list(resp)
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            assert not any(c.choices[0].delta.tool_calls for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            assert resp.choices[0].message.tool_calls is None
            content, finish = resp.choices[0].message.content, resp.choices[0].finish_reason
        assert content.startswith(HERMES.forced_start("get_weather") + " {")
        assert finish in ("stop", "length")
        record = engine.sessions.turns("alice/forced")[-1]
        assert (record.end, record.tool) == ("tool_call", "get_weather")


@pytest.mark.slow
def test_auto_with_a_weather_tool_answers_in_a_valid_shape(client):
    """What the 135M model chooses is not asserted (it answers in prose here), only that
    the reply is one of the two shapes."""
    choice = ask(client, QUESTION, tools=[WEATHER], tool_choice="auto").choices[0]
    if choice.finish_reason == "tool_calls":
        assert all(c.function.name == "get_weather" for c in choice.message.tool_calls)
    else:
        assert choice.message.tool_calls is None and choice.message.content


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "retrieval", "function": {"name": "a"}}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "a", "parameters": []}}]},
            "tools.0.function.parameters",
        ),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{**CALL, "function": {"name": "a", "arguments": {}}}],
                    }
                ]
            },
            "messages.0.tool_calls.0.function.arguments",
        ),
        (
            {"messages": [{"role": "user", "content": "hi", "tool_calls": [CALL]}]},
            "messages.0.tool_calls",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "1"}]},
            "messages.1.tool_call_id",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": None, "tool_calls": [CALL]},
                    {"role": "tool", "tool_call_id": "call_2", "content": "1"},
                ]
            },
            "messages.2.tool_call_id",
        ),
        (
            {
                "messages": [
                    {"role": "tool", "tool_call_id": "call_1", "content": "1"},
                    {"role": "assistant", "content": None, "tool_calls": [CALL]},
                ]
            },
            "messages.0.tool_call_id",
        ),
    ],
)
def test_bad_tool_shapes_are_400_naming_the_field(server, change, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    body.update(change)
    resp = httpx.post(
        server.v1 + "/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {ALICE_KEY}"},
        timeout=60,
    )
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.json()
