"""Tools and tool turns in a chat prompt: the model's chat template where it takes `tools`,
else a Hermes-style rendering into plain messages its template does take.

The fallback is what SmolLM2's model card and vLLM's `hermes` parser expect: the tools as
JSON inside `<tools></tools>` at the end of the system message, assistant calls written back
as the `<tool_call>` text the model produces, tool results in `<tool_response>` tags. It is a
function of the messages alone, so a tool loop's next prompt starts with the tokens of the
previous prompt and reply, whose KV the prefix cache and tiers keep.

Messages come in OpenAI's shapes (`tool_calls` with `arguments` as a JSON string,
`tool_call_id` on results); tools as OpenAI's `{"type": "function", "function": {...}}`.
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any

from kvtier.models.tool_parsers import TOOL_PARSERS, ToolCall, ToolParser

TOOLS_INSTRUCTION = """# Tools

You may call one or more functions to assist with the user query. You are provided with \
function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

_TOOLS_VARIABLE = re.compile(r"\btools\b")


def template_takes_tools(tokenizer: Any) -> bool:
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates: HF picks "tool_use" when given tools
        return "tool_use" in template
    return isinstance(template, str) and _TOOLS_VARIABLE.search(template) is not None


def template_input(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools to hand `apply_chat_template`."""
    if template_takes_tools(tokenizer):
        return [_hf_message(m) for m in messages], tools or None
    return hermes_messages(messages, tools), None


def hermes_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, str]]:
    plain = [_plain(m, TOOL_PARSERS["hermes"]) for m in messages]
    if not tools:
        return plain
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    instruction = TOOLS_INSTRUCTION.format(tools=listing)
    if plain and plain[0]["role"] == "system":
        plain[0] = {"role": "system", "content": f"{plain[0]['content']}\n\n{instruction}"}
    else:
        plain.insert(0, {"role": "system", "content": instruction})
    return plain


def _plain(message: dict[str, Any], parser: ToolParser) -> dict[str, Any]:
    if message["role"] == "tool":
        content = message.get("content") or ""
        return {"role": "tool", "content": f"<tool_response>\n{content}\n</tool_response>"}
    if not message.get("tool_calls"):
        return message
    calls = [
        parser.call_text(ToolCall(c["function"]["name"], c["function"]["arguments"]))
        for c in message["tool_calls"]
    ]
    content = message.get("content") or ""
    return {"role": message["role"], "content": "\n".join([content, *calls] if content else calls)}


def _hf_message(message: dict[str, Any]) -> dict[str, Any]:
    """Transformers' templates take a call's arguments as a mapping, not JSON text."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = dict(call["function"])
        with contextlib.suppress(ValueError):  # not JSON: the template gets the text
            function["arguments"] = json.loads(function["arguments"])
        calls.append({**call, "function": function})
    return {**message, "tool_calls": calls}
