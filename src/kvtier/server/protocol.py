"""OpenAI request shapes (the subset kvtier serves) and the error body.

Unknown fields are ignored, as OpenAI-compatible servers do (clients send extras such as
`logit_bias: null`); known fields are type-checked strictly, and values the engine cannot
honour (n > 1, logprobs, non-text content) are refused with a 400 that names the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = StrictInt | StrictFloat


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Model):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Model):
    include_usage: StrictBool = False


class _SamplingFields(_Model):
    model: StrictStr
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number | None = Field(default=None, ge=0, le=2)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=-1)  # vLLM extension
    n: StrictInt | None = Field(default=None, ge=1, le=1)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    ignore_eos: StrictBool | None = None  # vLLM extension
    stop_token_ids: list[StrictInt] | None = None  # vLLM extension
    presence_penalty: Number | None = Field(default=None, ge=-2, le=2)  # accepted, not applied
    frequency_penalty: Number | None = Field(default=None, ge=-2, le=2)  # accepted, not applied


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | list[StrictStr] | list[StrictInt]
    echo: StrictBool | None = None
    logprobs: StrictInt | None = None
    suffix: StrictStr | None = None


def error_body(
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
