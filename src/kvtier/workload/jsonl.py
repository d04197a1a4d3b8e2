"""Reading JSON-lines traces: bad lines become error messages with their line number, the rest
is read; field checks that say what was expected."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from kvtier.errors import KvtierError

log = logging.getLogger("kvtier.workload")

T = TypeVar("T")


class BadRecord(ValueError):
    """A record that cannot be used; the message says which field and why."""


def read_text(path: str | Path) -> str:
    path = Path(path)
    if not path.is_file():
        raise KvtierError(f"trace file not found: {path}")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KvtierError(f"cannot read {path}: {exc}") from None


def json_lines(text: str) -> Iterator[tuple[int, str]]:
    """(1-based line number, line) for every non-blank line."""
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            yield number, line


def parse_lines(
    path: str | Path, text: str, parse: Callable[[dict[str, Any]], T]
) -> tuple[list[tuple[int, T]], list[str]]:
    """Parse every line with `parse`; returns (line number, record) pairs and error messages.
    A file without one good line is an error."""
    records: list[tuple[int, T]] = []
    errors: list[str] = []
    for number, line in json_lines(text):
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise BadRecord(f"expected a JSON object, got {type(obj).__name__}")
            records.append((number, parse(obj)))
        except json.JSONDecodeError as exc:
            errors.append(f"line {number}: not valid JSON ({exc.msg})")
        except BadRecord as exc:
            errors.append(f"line {number}: {exc}")
    check_some(path, len(records), errors)
    return records, errors


def check_some(path: str | Path, good: int, errors: list[str]) -> None:
    if not good:
        first = f"; first error: {errors[0]}" if errors else ""
        raise KvtierError(f"{path}: no valid record ({len(errors)} bad{first})")


def warn_skipped(path: str | Path, errors: list[str]) -> None:
    """One warning line for everything a loader skipped (the list stays on the workload)."""
    if errors:
        log.warning("%s: skipped %d bad record(s); first: %s", path, len(errors), errors[0])


def _required(obj: dict[str, Any], key: str) -> Any:
    if key not in obj:
        raise BadRecord(f"missing field {key!r}")
    return obj[key]


def number(obj: dict[str, Any], key: str, minimum: float = 0.0) -> float:
    value = _required(obj, key)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
        raise BadRecord(f"field {key!r} must be a number >= {minimum:g}, not {value!r}")
    return float(value)


def whole(obj: dict[str, Any], key: str, minimum: int = 0) -> int:
    value = _required(obj, key)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BadRecord(f"field {key!r} must be a whole number >= {minimum}, not {value!r}")
    return value


def id_list(obj: dict[str, Any], key: str) -> tuple[int, ...]:
    """An optional list of integer ids (missing: empty)."""
    value = obj.get(key, [])
    if not isinstance(value, list) or not all(
        isinstance(item, int) and not isinstance(item, bool) for item in value
    ):
        raise BadRecord(f"field {key!r} must be a list of integers")
    return tuple(value)
