"""Load a model folder's tokenizer and render chat prompts into token ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def chat_token_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` rendered by the model's chat template, ready for generation."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # The template already writes its special tokens; adding more would double the BOS.
    # Not verbose: the engine checks prompts against its own context, with a clear error.
    return tokenizer.encode(text, add_special_tokens=False, verbose=False)
