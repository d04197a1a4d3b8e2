"""Load a trace file of any supported format, told or detected from its first record.

- `mooncake`: JSON lines of timestamp (ms), input/output_length, hash_ids (512 tokens each);
  sessions reconstructed from hash-id prefixes
- `bailian`: JSON lines of chat_id, parent_chat_id, timestamp (s), lengths, hash_ids (16 tokens
  each); sessions follow the parent chain
- `sharegpt`: a JSON array (or lines) of conversations: id, messages or conversations; one
  session each, times drawn by the generator's model
- `agentic`: LLMServingSim's JSON lines of sessions: arrival_time_ns, sub_requests of
  input/output_toks and tool_duration_ns (tool loops; `agentic_trace.py`)

A trace shipped in `kvtier/data/traces/` is also reachable by its name (`sample`: the first
minutes of Mooncake's conversation trace), wherever kvtier is installed.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from kvtier.errors import KvtierError
from kvtier.workload.agentic_trace import load_agentic
from kvtier.workload.bailian import load_bailian
from kvtier.workload.config import GeneratorConfig
from kvtier.workload.jsonl import json_lines, read_text
from kvtier.workload.model import Workload
from kvtier.workload.mooncake import load_mooncake
from kvtier.workload.scale import scale_to_context
from kvtier.workload.sharegpt import load_sharegpt
from kvtier.workload.text import LengthFn, approx_tokens

FORMATS = ("mooncake", "bailian", "sharegpt", "agentic")
_PEEK_LINES = 20  # a few bad lines at the top should not hide the format


def bundled_trace_names() -> list[str]:
    folder = resources.files("kvtier") / "data" / "traces"
    return sorted(
        p.name.removesuffix(".jsonl") for p in folder.iterdir() if p.name.endswith(".jsonl")
    )


def trace_path(spec: str | Path) -> Path:
    """`spec` as a path; a bundled trace's file when no such file exists and `spec` is a
    bundled name."""
    path = Path(spec)
    if path.exists() or str(spec) not in bundled_trace_names():
        return path
    return Path(str(resources.files("kvtier") / "data" / "traces" / f"{spec}.jsonl"))


def detect_format(path: str | Path) -> str:
    """The format of a trace file, from the fields of its first JSON record."""
    text = read_text(path)
    if text.lstrip().startswith("["):
        return "sharegpt"
    for count, (_, line) in enumerate(json_lines(text)):
        if count == _PEEK_LINES:
            break
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict):
            continue
        if "chat_id" in obj:
            return "bailian"
        if "sub_requests" in obj or "input_toks" in obj:
            return "agentic"
        if "messages" in obj or "conversations" in obj:
            return "sharegpt"
        if "hash_ids" in obj or "input_length" in obj:
            return "mooncake"
        raise KvtierError(
            f"cannot tell the format of {path} from its fields ({', '.join(sorted(obj))}); "
            f"pass --format ({', '.join(FORMATS)})"
        )
    raise KvtierError(f"{path} holds no JSON record in its first {_PEEK_LINES} lines")


def load_trace(
    path: str | Path,
    trace_format: str = "auto",
    *,
    scale_to: int | None = None,
    config: GeneratorConfig | None = None,
    seed: int = 0,
    length: LengthFn = approx_tokens,
) -> Workload:
    """Read a trace. `scale_to` shrinks lengths to fit that context (see `scale.py`);
    `config`, `seed` and `length` only matter for sharegpt (timing model, token counts)."""
    path = trace_path(path)
    if trace_format == "auto":
        trace_format = detect_format(path)
    if trace_format == "mooncake":
        workload = load_mooncake(path)
    elif trace_format == "bailian":
        workload = load_bailian(path)
    elif trace_format == "sharegpt":
        workload = load_sharegpt(path, config=config, seed=seed, length=length)
    elif trace_format == "agentic":
        workload = load_agentic(path)
    else:
        choices = ", ".join(FORMATS)
        raise KvtierError(f"unknown trace format {trace_format!r}; choose auto, {choices}")
    return workload if scale_to is None else scale_to_context(workload, scale_to)
