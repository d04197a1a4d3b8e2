"""The CPU a benchmark's figures come from: its model and the features its kernels pick paths
by, read from /proc/cpuinfo."""

from __future__ import annotations

from kvtier.host_cpu import host_cpu

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
