"""Load a model folder's tokenizer and render chat prompts into token ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def chat_token_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    reply_start: str = "",
) -> list[int]:
    """Token ids of `messages` (and `tools`) rendered by the model's chat template, ready
    for generation; `reply_start` begins the assistant's reply (a forced tool call)."""
    from kvtier.models.tool_prompt import template_input

    messages, tools = template_input(tokenizer, messages, tools)
    text = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    text += reply_start
    # The template already writes its special tokens; adding more would double the BOS.
    # Not verbose: the engine checks prompts against its own context, with a clear error.
    return tokenizer.encode(text, add_special_tokens=False, verbose=False)
