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


def test_vllm_wheel_list_is_the_resolution_less_what_the_machine_has(tmp_path: Path) -> None:
    def item(name: str, version: str) -> dict:
        return {"metadata": {"name": name, "version": version}}

    report = {
        "install": [
            item("vllm", "0.34.0"),
            item("torch", "2.14.0"),  # the machine's is another version: carried
            item("Jinja2", "3.1.6"),  # the machine has this one: left out
            item("nvidia-nccl-cu13", "2.30.7"),
        ]
    }
    (tmp_path / "report.json").write_text(json.dumps(report))
    (tmp_path / "freeze.txt").write_text("torch==2.11.0\njinja2==3.1.6\n# a comment\n")
    done = run_benchmark(
        "gpu_wheels.py", "--out", str(tmp_path), "--vllm-report", str(tmp_path / "report.json"),
        "--machine-freeze", str(tmp_path / "freeze.txt"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    pins = (tmp_path / "vllm" / "requirements.txt").read_text().split()
    assert pins == ["nvidia-nccl-cu13==2.30.7", "torch==2.14.0", "vllm==0.34.0"]
    (tmp_path / "report.json").write_text(json.dumps({"install": [item("torch", "2.14.0")]}))
    done = run_benchmark(
        "gpu_wheels.py", "--out", str(tmp_path), "--vllm-report", str(tmp_path / "report.json")
    )
    assert done.returncode == 2 and "resolves no vllm" in done.stderr


def gpu_check_dry_run(wheelhouse: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "WHEELHOUSE": str(wheelhouse), "GPU_VENV": str(wheelhouse / "venv")}
    return subprocess.run(
        ["bash", str(BENCHMARKS / "gpu_check.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_gpu_check_dry_run_prints_every_step_and_runs_none(tmp_path: Path) -> None:
    syntax = subprocess.run(["bash", "-n", str(BENCHMARKS / "gpu_check.sh")], capture_output=True)
    assert syntax.returncode == 0, syntax.stderr
    done = gpu_check_dry_run(tmp_path, "--dry-run")  # no wheelhouse, no Python 3.12 needed
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any("gpu_check.py --device cuda" in line for line in lines)
    assert any(
        "-m requires_cuda" in line and "test_vllm_kv_port_copies.py" in line for line in lines
    )
    assert any(line.startswith("skipped: no") and "gpu-wheels-vllm" in line for line in lines)
    assert not (tmp_path / "venv").exists()

    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "requirements.txt").write_text("vllm==0.34.0\n")
    done = gpu_check_dry_run(tmp_path, "--dry-run")
    assert done.returncode == 0, done.stderr
    commands = [line for line in done.stdout.splitlines() if line.startswith("+ ")]
    bench = [c for c in commands if "vllm_connector.py" in c]
    assert len(bench) == 1 and "vllm+offloading" in bench[0] and "--device cuda" in bench[0]
    assert any("--contexts 8192" in c for c in commands if "gpu_check.py" in c)
    for command in commands:  # every step under a timeout within the 470 s deadline
        if "pip install" in command or "python benchmarks/" in command:
            assert int(command.split()[2]) <= 470, command
    assert not (tmp_path / "venv").exists()

    assert gpu_check_dry_run(tmp_path, "--bogus").returncode == 2


def test_vllm_benchmark_setups_and_their_connector_configs() -> None:
    done = run_benchmark(
        "vllm_connector.py", "--dry-run", "--device", "cuda", "--host-gib", "1",
        "--setups", "vllm,vllm+kvtier,vllm+offloading",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    configs = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert json.loads(configs["vllm"])["kv_transfer_config"] is None
    kvtier = json.loads(configs["vllm+kvtier"])["kv_transfer_config"]
    assert kvtier["kv_connector"] == "KvtierConnector"
    assert kvtier["kv_connector_extra_config"]["tiers"]["host_bytes"] == 1 << 30
    offloading = json.loads(configs["vllm+offloading"])["kv_transfer_config"]
    assert offloading["kv_connector"] == "OffloadingConnector"
    assert offloading["kv_connector_extra_config"] == {
        "cpu_bytes_to_use": 1 << 30,
        "block_size": 256,
    }
    refused = run_benchmark("vllm_connector.py", "--dry-run", "--setups", "vllm+offloading")
    assert refused.returncode == 2 and "needs --device cuda" in refused.stderr
