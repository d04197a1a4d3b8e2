"""The CPU a benchmark's figures come from: its model and the features its kernels pick paths
by, read from /proc/cpuinfo."""

from __future__ import annotations

import pytest

from kvtier.engine.config import EngineConfig, resolve_dtype
from kvtier.errors import KvtierError
from kvtier.host_cpu import HostCpu, host_cpu

AMX_XEON = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""
EPYC = """processor\t: 0
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni
"""


def test_an_amx_host_is_named_with_its_tiles(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(AMX_XEON)
    cpu = host_cpu(info)
    assert cpu.model == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert cpu.features == (
        "avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8",
    )  # fmt: skip
    assert cpu.amx and cpu.describe().endswith("; AMX")


def test_a_host_without_amx_says_so(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(EPYC)
    cpu = host_cpu(info)
    assert cpu.features == ("avx2", "avx512f", "avx512_bf16", "avx512_vnni")
    assert cpu.amx is False
    assert cpu.describe().startswith("AMD EPYC, ") and cpu.describe().endswith("; no AMX")
    assert cpu.as_dict()["features"] == list(cpu.features)


def test_without_cpuinfo_the_features_are_unknown_not_absent(tmp_path):
    cpu = host_cpu(tmp_path / "missing")
    assert cpu.features is None and cpu.amx is None
    assert cpu.describe().endswith("CPU features unknown")


def test_this_host_reads():
    cpu = host_cpu()
    assert cpu.model and cpu.cores >= 1


AVX2_EPYC = """processor\t: 0
model name\t: AMD EPYC
flags\t\t: fpu sse2 fma avx avx2
"""


@pytest.fixture
def cpus(tmp_path) -> dict[str, HostCpu]:
    """Three hosts as their /proc/cpuinfo reads, by the features `auto` decides on."""
    read = {}
    for name, text in (("amx", AMX_XEON), ("avx512_bf16", EPYC), ("avx2", AVX2_EPYC)):
        (tmp_path / name).write_text(text)
        read[name] = host_cpu(tmp_path / name)
    return read


def test_dtype_auto_is_bfloat16_only_where_the_cpu_multiplies_it(tmp_path, cpus):
    assert resolve_dtype("auto", "cpu", cpus["amx"]) == "bfloat16"
    assert resolve_dtype("auto", "cpu", cpus["avx512_bf16"]) == "bfloat16"
    assert resolve_dtype("auto", "cpu", cpus["avx2"]) == "float32"
    assert resolve_dtype("auto", "cuda:0", cpus["avx2"]) == "bfloat16"  # the GPU's, not the CPU's
    unknown = host_cpu(tmp_path / "missing")
    assert resolve_dtype("auto", "cpu", unknown) == "float32"  # no proof of bf16 hardware
    for explicit in ("bfloat16", "float32"):  # a named dtype is kept on any host
        assert resolve_dtype(explicit, "cpu", cpus["avx2"]) == explicit
        assert resolve_dtype(explicit, "cpu", cpus["amx"]) == explicit
    with pytest.raises(KvtierError, match="dtype must be 'auto', 'bfloat16' or 'float32'"):
        resolve_dtype("float16", "cpu", cpus["amx"])
    with pytest.raises(KvtierError, match="dtype must be 'auto'"):
        EngineConfig(dtype="fp8")  # type: ignore[arg-type]
    assert EngineConfig().dtype == "auto"
