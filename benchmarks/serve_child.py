"""`kvtier serve` as a child process of a benchmark: started on a free loopback port, its
output to a log file (an unread pipe could block it), returned once /health answers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx


def start_serve(
    flags: list[str], log: Path, src: Path | None = None
) -> tuple[str, subprocess.Popen]:
    """(base URL, process) of `kvtier serve FLAGS`; `src` serves another checkout's code
    (its `src` folder on PYTHONPATH), to measure before and after a change in one sitting."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src.resolve())
    argv = [sys.executable, "-m", "kvtier.cli", "serve", "--host", "127.0.0.1", "--port", "0"]
    with log.open("w") as handle:
        server = subprocess.Popen([*argv, *flags], stdout=handle, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        found = re.search(r"listening on (http://\S+)", log.read_text())
        if found and httpx.get(found.group(1) + "/health", timeout=5).status_code == 200:
            return found.group(1), server
        if server.poll() is not None:
            break
        time.sleep(0.2)
    server.kill()
    raise SystemExit(f"kvtier serve did not start:\n{log.read_text()}")
