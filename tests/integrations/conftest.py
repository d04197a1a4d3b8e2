"""Real vLLM for the connector tests: `vllm_driver.py` runs under .venv-vllm's python (vLLM
lives in its own venv, `make vllm`), and the tests read the JSON it writes.

Without .venv-vllm the vLLM tests are skipped, except in CI (CI=true), where .ci/run builds
the venv first and a missing one is a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
DRIVER = Path(__file__).parent / "vllm_driver.py"
BLOCK = 128  # vLLM-CPU's block size, and the connector's chunk size in these tests

_spec = importlib.util.spec_from_file_location("_kvtier_vllm_driver", DRIVER)
driver = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(driver)  # stdlib only at import: vLLM loads inside main()


def need_vllm() -> None:
    if VLLM_PYTHON.exists():
        return
    message = f"{VLLM_PYTHON} is missing: `make vllm` builds vLLM's venv"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def run_driver(tmp: Path, mode: str, *args: str) -> dict:
    """One vLLM process through the driver's scenario; its JSON result."""
    need_vllm()
    out = tmp / f"{mode}.json"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "src"),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the connector's report is read in-process
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
    }
    done = subprocess.run(
        [str(VLLM_PYTHON), str(DRIVER), mode, "--out", str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        pytest.fail(f"vllm_driver.py {mode} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def loadable(stored_tokens: int, prompt_tokens: int) -> int:
    """Prompt tokens a connector can fill: whole blocks it stored, short of the last prompt
    token (which vLLM always computes)."""
    return min(stored_tokens // BLOCK, (prompt_tokens - 1) // BLOCK) * BLOCK


def computed(turn: dict) -> int:
    """Tokens whose KV a finished turn left: its prompt and all but the last output token."""
    return turn["prompt_tokens"] + len(turn["output"]) - 1


@pytest.fixture(scope="session")
def baseline(tmp_path_factory) -> dict:
    """vLLM without the connector through the same turns."""
    return run_driver(tmp_path_factory.mktemp("vllm-baseline"), "baseline")
