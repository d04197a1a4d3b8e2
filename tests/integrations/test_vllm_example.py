"""docs/vllm.md's Python example, run as the page shows it under vLLM's venv: kvtier's host
tier gives back the prompt's KV after `reset_prefix_cache()`, the answer is the same, and
vLLM's log names the connector's settings and the failure policy it runs with."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.integrations.conftest import VLLM_PYTHON, need_vllm

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "vllm.md"


def example() -> str:
    section = PAGE.read_text().split("## Use it from Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_the_python_example_runs_as_shown(tmp_path: Path) -> None:
    need_vllm()
    script = tmp_path / "example.py"
    script.write_text(example())
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the script sets what it needs
    done = subprocess.run(
        [str(VLLM_PYTHON), str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    restored = re.search(r"prompt tokens: (\d+), restored: (\d+)", done.stdout)
    assert restored, done.stdout[-2000:]
    prompt, cached = int(restored.group(1)), int(restored.group(2))
    assert cached >= 256 and cached <= prompt  # whole chunks came back from the host tier
    assert "same answer: True" in done.stdout
    assert re.search(r"kvtier: tiers host .*; kv_load_failure_policy=recompute", output), output[
        -4000:
    ]
