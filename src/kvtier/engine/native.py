"""C++ kernels as kvtier builds them: the system's C++ compiler (`$CXX`, else `g++`) turns one
source file shipped beside the engine's modules into a shared library, cached under
`kvtier.paths.cache_dir()/native` and loaded with ctypes (no torch headers, no pybind, no
ninja: a kernel exports plain C functions taking pointers).

Built with `-O3 -march=native -fopenmp`: for the CPU it runs on, so the cache key holds the
compiler's version and this CPU's feature flags as well as the source and the flags. OpenMP
resolves at load time to the `libgomp.so.1` already in the process, which is torch's own once
torch is imported (callers import torch first): a kernel's parallel loops then run on the
threads torch's operations use. Where there is no compiler, or it fails, `load` logs one line
and returns None and the caller keeps its other path: correctness never depends on a build.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvtier.paths import cache_dir

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC")


def cpu_flags() -> str:
    """The CPU's feature flags (what -march=native builds for), or the machine name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.machine()


def load(source: Path) -> ctypes.CDLL | None:
    """The shared library built from `source` (built now unless cached)."""
    compiler = shutil.which(os.environ.get("CXX") or "g++")
    if compiler is None:
        log.warning("no C++ compiler found (g++ or $CXX): %s not built", source.name)
        return None
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, check=True
        ).stdout
        key = hashlib.sha256(
            "\0".join([source.read_text(), " ".join(FLAGS), version, cpu_flags()]).encode()
        ).hexdigest()[:16]
        built = cache_dir() / "native" / f"{source.stem}-{key}.so"
        if not built.exists():
            built.parent.mkdir(parents=True, exist_ok=True)
            # compiled beside its final name, then renamed: concurrent builds never see half a file
            with tempfile.TemporaryDirectory(dir=built.parent) as tmp:
                partial = Path(tmp) / built.name
                subprocess.run(
                    [compiler, *FLAGS, "-o", str(partial), str(source)],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                os.replace(partial, built)
        return ctypes.CDLL(str(built))
    except subprocess.CalledProcessError as e:
        errors = [line for line in e.stderr.splitlines() if "error" in line] or [str(e)]
        log.warning("building %s failed (%s): kept the other path", source.name, errors[0])
    except OSError as e:
        log.warning("building %s failed (%s): kept the other path", source.name, e)
    return None
