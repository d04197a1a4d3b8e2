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
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python-version", default="3.12")
    parser.add_argument("--out", type=Path, required=True, help="the wheelhouse folder")
    args = parser.parse_args()
    pins = closure(args.python_version)
    args.out.mkdir(parents=True, exist_ok=True)
    pinned = args.out / "requirements.txt"
    pinned.write_text("".join(f"{name}{pin}\n" for name, pin in pins.items()))
    (args.out / "install.txt").write_text("".join(f"{r}\n" for r in direct(args.python_version)))
    print(f"{len(pins)} packages -> {pinned}")


if __name__ == "__main__":
    main()
