"""benchmarks/gpu_check.py and gpu_wheels.py stay runnable between GPU runs: the check's smoke
mode on CPU (the same phases as on a GPU, tiny shapes) and the wheel list's closure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def run_benchmark(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(BENCHMARKS), str(BENCHMARKS.parent / "src"), env.get("PYTHONPATH", "")]
    )
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_smoke_mode_runs_every_phase_on_cpu(tmp_path: Path) -> None:
    done = run_benchmark(
        "gpu_check.py", "--device", "cpu", "--smoke", "--out", str(tmp_path), "--workdir",
        str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["weights"] == "random (timing only)"
    parity = report["parity"]
    assert parity["passed"] and parity["prompt_tokens"] == 64
    # CPU against itself in float32 is exact; bfloat16 differs, but not by much
    assert parity["cpu float32"]["max_abs_diff"] == 0
    assert 0 < parity["cpu bfloat16"]["mean_abs_diff"] < 0.5
    measured, predicted = report["resume"]["256"], report["prediction"]["256"]
    for source in ("recompute", "host", "disk"):
        assert measured[f"{source}_ttft_ms"] > 0
        assert predicted[f"{source}_ttft_ms"] > 0
    # the profile prices a restore below recomputing the prompt
    assert predicted["host_ttft_ms"] < predicted["recompute_ttft_ms"]
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| 256 | host |" in table and "RANDOM-weight" in table
    assert not list(tmp_path.glob("kvtier-gpu-check-*"))  # the random model is cleaned up


def test_wheel_list_leaves_out_what_the_gpu_machine_brings(tmp_path: Path) -> None:
    done = run_benchmark("gpu_wheels.py", "--python-version", "3.12", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    pins = (tmp_path / "requirements.txt").read_text().split()
    names = {line.split("==")[0] for line in pins}
    assert {"numpy", "pydantic", "pydantic-core", "redis", "pytest", "setuptools"} <= names
    assert not names & {"torch", "transformers", "triton"}
    assert not any(name.startswith("nvidia-") for name in names)
    assert all("==" in line for line in pins if line.split("==")[0] in ("numpy", "redis"))
    install = (tmp_path / "install.txt").read_text().split()
    assert "cryptography>=50" in install  # kvtier's own ranges, so an older one is replaced
    assert not [r for r in install if r.startswith(("torch", "transformers"))]
