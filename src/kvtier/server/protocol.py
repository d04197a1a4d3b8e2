"""OpenAI request shapes (the subset kvtier serves) and the error body.

Unknown fields are ignored, as OpenAI-compatible servers do (clients send extras such as
`logit_bias: null`); known fields are type-checked strictly, and values the engine cannot
honour (n > 1, logprobs, non-text content) are refused with a 400 that names the field.
Every string must be encodable Unicode (JSON can carry a lone surrogate such as "\\udfff",
which the tokenizer cannot take) and every integer fits 64 bits, so nothing a client sends
reaches the engine as a value it would fail on.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
)

from kvtier.engine.sampling import INT64_MAX, INT64_MIN

MAX_STOP_STRINGS = 16  # checked against the text after every token: bounds a request's cost
MAX_STOP_TOKEN_IDS = 256
MAX_TOOLS = 128  # OpenAI's limits
MAX_TOOL_NAME_CHARS = 64


def _encodable(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode (lone surrogate at position {exc.start})") from None
    return text


def _encodable_json(value: dict[str, Any]) -> dict[str, Any]:
    _encodable(json.dumps(value, ensure_ascii=False))
    return value


Text = Annotated[StrictStr, AfterValidator(_encodable)]
JSONObject = Annotated[dict[str, Any], AfterValidator(_encodable_json)]
Int64 = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)]
Number = StrictInt | StrictFloat


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Model):
    type: Literal["text"]
    text: Text


class FunctionCall(_Model):
    name: Annotated[Text, Field(min_length=1)]
    arguments: Text  # JSON, as the reply carried it; sent back verbatim into the prompt


class MessageToolCall(_Model):
    id: Annotated[Text, Field(min_length=1)]
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant only (checked in tools.py)
    tool_call_id: Text | None = None  # tool: the call this message answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Model):
    include_usage: StrictBool = False


class _SamplingFields(_Model):
    model: Text
    max_tokens: Int64 | None = Field(default=None, ge=1)
    # Below 1e-5 the engine samples greedily (SAMPLING_EPS): no overflow from tiny values.
    temperature: Number | None = Field(default=None, ge=0, le=2)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    top_k: Int64 | None = Field(default=None, ge=-1)  # vLLM extension
    n: StrictInt | None = Field(default=None, ge=1, le=1)
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: Int64 | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    kvtier_session: dict[Text, Any] | None = None  # session hints: session_hints_request.py
    kv_transfer_params: dict[Text, Any] | None = None  # vLLM's; load limits are read
    nvext: dict[Text, Any] | None = None  # Dynamo's extensions: agent_hints.priority is read
    ignore_eos: StrictBool | None = None  # vLLM extension
    stop_token_ids: Annotated[list[Int64], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    presence_penalty: Number | None = Field(default=None, ge=-2, le=2)  # accepted, not applied
    frequency_penalty: Number | None = Field(default=None, ge=-2, le=2)  # accepted, not applied


class FunctionDefinition(_Model):
    name: Annotated[Text, Field(min_length=1, max_length=MAX_TOOL_NAME_CHARS)]
    description: Text | None = None
    parameters: JSONObject | None = None  # a JSON Schema, shown to the model as given
    strict: StrictBool | None = None  # accepted; decoding is not constrained


class ToolDefinition(_Model):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Model):
    name: Text


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    max_completion_tokens: Int64 | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None


class CompletionRequest(_SamplingFields):
    prompt: Text | list[Text] | list[Int64]
    echo: StrictBool | None = None
    logprobs: Int64 | None = None
    suffix: Text | None = None


def error_body(
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
