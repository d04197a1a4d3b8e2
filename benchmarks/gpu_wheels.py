"""The wheels benchmarks/gpu_check.sh installs offline: kvtier's runtime dependencies, minus
what the GPU machine brings (torch, transformers and theirs), plus pytest and setuptools, for
another Python and platform.

    python benchmarks/gpu_wheels.py --out wheelhouse

Walks kvtier's declared dependencies through the installed distributions of the running
environment (the versions this repo is tested with), evaluating markers for the target Python,
and writes one `name==version` per line (a bare name for a package only the target needs): the
closure `make gpu-wheels` downloads with `pip download --no-deps --only-binary=:all:` for that
Python and platform. Pinned exactly, so the wheelhouse holds the versions tested here; the
install on the GPU machine names them unpinned, so whatever the machine already has (through
transformers) is kept when it satisfies kvtier's own ranges: `install.txt` lists those
(kvtier's direct requirements, the machine's packages left out), `requirements.txt` the pins.

The vLLM comparison needs a CUDA vLLM, which pins its own torch (and the nvidia-* wheels that
torch pins): a separate, larger set in `vllm/`, installed into a venv of its own on the GPU
machine so the machine's torch stays what the rest of the check uses. `make gpu-wheels-vllm`
has pip resolve `vllm==VERSION` for the target (a `pip install --dry-run --report`), then

    python benchmarks/gpu_wheels.py --vllm-report report.json [--machine-freeze freeze.txt] \\
        --out wheelhouse

writes `vllm/requirements.txt`: every package of that resolution, pinned, less those the GPU
machine already has at the same version (`--machine-freeze`: its `pip freeze`; without one
nothing is left out).
"""

from __future__ import annotations

import argparse
import json
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# Brought by the GPU machine; never downloaded, never installed over.
MACHINE = {"torch", "transformers", "triton"}
# pytest: the check also runs the tests marked requires_cuda. setuptools: torch requires a newer
# one than a Python 3.11 venv starts with, and pip re-checks torch's requirements.
EXTRA = ["pytest", "setuptools"]


def target_env(python_version: str) -> dict[str, str]:
    env = {"python_version": python_version, "python_full_version": f"{python_version}.0"}
    env |= {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}
    return env | {"extra": ""}


def direct(python_version: str) -> list[str]:
    """kvtier's own requirements (with their ranges) that the GPU machine does not bring."""
    env = target_env(python_version)
    reqs = [Requirement(r) for r in [*(metadata.requires("kvtier") or []), *EXTRA]]
    return [
        str(r)
        for r in reqs
        if (r.marker is None or r.marker.evaluate(env)) and canonicalize_name(r.name) not in MACHINE
    ]


def closure(python_version: str) -> dict[str, str]:
    env = target_env(python_version)
    found: dict[str, str] = {}
    todo = [Requirement(r) for r in [*(metadata.requires("kvtier") or []), *EXTRA]]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if req.marker is not None and not req.marker.evaluate(env):
            continue  # extras (dev) and other platforms
        if name in found or name in MACHINE or name.startswith("nvidia-"):
            continue
        try:
            found[name] = f"=={metadata.version(name)}"
        except metadata.PackageNotFoundError:
            # needed only on the target (a marker false here): the newest, its deps unwalked
            found[name] = ""
            continue
        todo += [Requirement(r) for r in metadata.requires(name) or []]
    return dict(sorted(found.items()))


def vllm_pins(report: dict, machine: dict[str, str]) -> dict[str, str]:
    """name -> version of each package in pip's resolution `report` (`--report` JSON) that the
    machine does not have at that version."""
    pins = {}
    for item in report["install"]:
        name = canonicalize_name(item["metadata"]["name"])
        version = item["metadata"]["version"]
        if machine.get(name) != version:
            pins[name] = version
    return dict(sorted(pins.items()))


def read_freeze(path: Path) -> dict[str, str]:
    """`pip freeze` lines (name==version) as name -> version; other lines are ignored."""
    found = {}
    for line in path.read_text().splitlines():
        name, sep, version = line.strip().partition("==")
        if sep and name and not name.startswith("#"):
            found[canonicalize_name(name)] = version.strip()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python-version", default="3.12")
    parser.add_argument("--out", type=Path, required=True, help="the wheelhouse folder")
    parser.add_argument("--vllm-report", type=Path, help="pip's resolution of vllm (JSON)")
    parser.add_argument("--machine-freeze", type=Path, help="the GPU machine's pip freeze")
    args = parser.parse_args()
    if args.vllm_report:
        machine = read_freeze(args.machine_freeze) if args.machine_freeze else {}
        pins = vllm_pins(json.loads(args.vllm_report.read_text()), machine)
        if "vllm" not in pins:
            parser.error(f"{args.vllm_report} resolves no vllm")
        folder = args.out / "vllm"
        folder.mkdir(parents=True, exist_ok=True)
        pinned = folder / "requirements.txt"
        pinned.write_text("".join(f"{name}=={v}\n" for name, v in pins.items()))
        print(f"{len(pins)} packages (vllm=={pins['vllm']}) -> {pinned}")
        return
    pins = closure(args.python_version)
    args.out.mkdir(parents=True, exist_ok=True)
    pinned = args.out / "requirements.txt"
    pinned.write_text("".join(f"{name}{pin}\n" for name, pin in pins.items()))
    (args.out / "install.txt").write_text("".join(f"{r}\n" for r in direct(args.python_version)))
    print(f"{len(pins)} packages -> {pinned}")


if __name__ == "__main__":
    main()
