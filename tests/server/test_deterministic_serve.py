"""Deterministic mode through `kvtier serve` (bf16, the embedded model): every answer of
conversations restored from a host tier, from disk after SIGKILL and restart, from Redis after
restarts, and on a second replica behind nginx after the first is killed, equals the answer
of a server without tiers to the same prompt, with turns batched together. The runs are
`benchmarks/deterministic_serve.py`'s (its default-mode counts are a measurement, not a test)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.engine import prefill_attention
from tests.bench.test_gpu_check import BENCHMARKS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not prefill_attention.available(), reason="needs AVX512_BF16 and a C++ compiler"
    ),
]

# where each scenario's restored tokens come from
SOURCE = {"host": "host", "disk": "disk", "redis": "remote", "replicas": "remote"}


def test_restored_batched_and_crashed_turns_answer_as_recomputed(tmp_path: Path):
    for tool in ("redis-server", "nginx"):
        if shutil.which(tool) is None:
            if os.environ.get("CI"):
                pytest.fail(f"{tool} is not installed in CI (make system installs it)")
            pytest.skip(f"{tool} is not installed")
    out = tmp_path / "runs.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(BENCHMARKS), str(BENCHMARKS.parent / "src"), env.get("PYTHONPATH", "")]
    )
    command = [sys.executable, str(BENCHMARKS / "deterministic_serve.py")]
    command += ["--modes", "deterministic", "--sessions", "4", "--rounds", "3"]
    command += ["--answer-tokens", "64", "--pool-blocks", "40", "--out", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]["deterministic"]
    assert set(results) == set(SOURCE)
    for scenario, run in results.items():
        assert run["answers"] == 12
        assert run["differing"] == 0, (scenario, run)
        # the history did come back from the tier, not recomputed
        assert run["prompt_token_sources"].get(SOURCE[scenario], 0) > 0, (scenario, run)
