"""What `kvtier bench` prints while and after it replays: progress, the stored-forms line, the
warning for a replay without resumed turns, and the command line recorded in results.json.
Shared by the engine replay (command.py) and the replay against a server (server_run.py)."""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.results.records import RunRecords


def forms_line(tiers: dict[str, Any]) -> str | None:
    """Blocks restored per quantized form and the encodes behind them (None: none), from the
    connector's stats: what `[policy] max_accuracy_loss` let the policy choose."""
    # imported here: kvtier.tiers pulls in torch, and building the CLI parser must not
    from kvtier.vocab import FORMS, FULL

    counters = tiers.get("counters", {})
    # the connector counts all restored blocks, and those of each lossy form apart
    lossy = {form: counters.get(f"restored_blocks_{form}", 0) for form in FORMS if form != FULL}
    lossy = {form: n for form, n in lossy.items() if n}
    restored = {FULL: counters.get("restored_blocks", 0) - sum(lossy.values()), **lossy}
    recodes = tiers.get("recodes", {})
    if len(restored) == 1 and not recodes:
        return None
    blocks = " / ".join(f"{form} {n:,}" for form, n in restored.items())
    encoded = "; ".join(
        f"{name} {r['ops']:,} chunks, {r['seconds']:.2f} s on the mover's worker"
        for name, r in recodes.items()
    )
    return f"blocks restored from tiers: {blocks}; encoded: {encoded or 'none'}"


def warn_without_resumed(runs: Sequence[RunRecords], resume_after_s: float) -> None:
    """Resumed turns are where policies differ; a replay without any compares nothing."""
    without = [run.policy for run in runs if all(r.turn_kind != "resumed" for r in run.requests)]
    if without:
        print(
            f"warning: no resumed turns in the replay of {', '.join(without)}: no session came "
            f"back after more than {resume_after_s:g} s, so no turn needed the paused KV the "
            "policies decide about (replay more sessions, or pick them with --sessions N)"
        )


class Progress:
    """Requests finished, on stderr: a rich progress bar on a terminal; elsewhere (a log file,
    a pipe, CI) a plain line when the run starts, at each tenth of its requests and at its
    end, so a run of minutes is seen to move. Nothing with --no-progress."""

    def __init__(self, name: str, total: int, disabled: bool) -> None:
        self.name, self.total, self.disabled = name, total, disabled
        self.bar: Any = None

    def __enter__(self):
        if self.disabled:
            return lambda: None
        from rich.console import Console

        if not Console(stderr=True).is_terminal:
            return self._lines()
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.bar = Progress(
            TextColumn(f"{self.name:>10}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
        )
        self.bar.start()
        task = self.bar.add_task(self.name, total=self.total)
        return lambda: self.bar.advance(task)

    def _lines(self):
        name, total, started = self.name, self.total, time.perf_counter()
        print(f"{name}: replaying {total:,} requests", file=sys.stderr, flush=True)
        done = 0

        def advance() -> None:
            nonlocal done
            done += 1
            if done * 10 // total > (done - 1) * 10 // total:  # a tenth crossed, or the end
                seconds = time.perf_counter() - started
                print(
                    f"{name}: {done:,}/{total:,} requests finished, {seconds:,.0f} s",
                    file=sys.stderr,
                    flush=True,
                )

        return advance

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def command_line() -> str:
    """The bench command as typed, for results.json."""
    argv = sys.argv[1:]
    argv = argv[1:] if argv and argv[0] == "bench" else argv
    return "kvtier bench " + " ".join(shlex.quote(a) for a in argv)
