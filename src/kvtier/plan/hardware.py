"""Accelerator and link presets: peak figures from vendor datasheets, plus the share of peak
that real work reaches.

Accelerators (bf16 tensor-core throughput *without* sparsity, which datasheets print as half the
headline "with sparsity" number):

- H100 SXM: 989 TFLOP/s, 3.35 TB/s HBM3, 80 GB. NVIDIA H100 Tensor Core GPU datasheet,
  https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
- H200 SXM: 989 TFLOP/s, 4.8 TB/s HBM3e, 141 GB. NVIDIA H200 product page and datasheet,
  https://www.nvidia.com/en-us/data-center/h200/
- A100 80GB SXM: 312 TFLOP/s, 2.04 TB/s HBM2e, 80 GB. NVIDIA A100 datasheet,
  https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
- L40S: 362 TFLOP/s, 864 GB/s GDDR6, 48 GB. NVIDIA L40S datasheet,
  https://www.nvidia.com/en-us/data-center/l40s/

The datasheets' memory "GB" are binary: HBM stacks come in power-of-two sizes, and an "80 GB"
H100 reports about 79.6 GiB in `nvidia-smi` (the CUDA context takes a little of that, ECC on
the L40S more). We read them as GiB; measure with `kvtier calibrate` before relying on the last
few percent.

Links are what a bulk copy reaches, not the line rate, where the two differ:

- PCIe Gen4 x16: 32 GB/s per direction on paper, ~25 GB/s for pinned-memory cudaMemcpy.
- PCIe Gen5 x16: 64 GB/s per direction on paper, ~50 GB/s pinned.
- NVMe: enterprise SSD sequential reads, ~5 GB/s for PCIe Gen4 drives and ~14 GB/s for Gen5
  drives (the 5-14 GB/s range the project's source article quotes).
- Ethernet: line rate, 100 GbE = 12.5 GB/s and 400 GbE = 50 GB/s; protocol overhead and the
  remote store's own speed only lower these.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.errors import KvtierError

TERA = 10**12
GIB = 2**30

# Share of peak FLOP/s a long prefill reaches (MFU). Large-batch prefill on H100 typically
# lands at 40-60%; override with --efficiency.
DEFAULT_EFFICIENCY = 0.5


@dataclass(frozen=True)
class Accelerator:
    key: str
    name: str
    peak_flops: float  # bf16 dense, FLOP/s
    memory_bytes: int
    memory_bandwidth: float  # bytes/s


@dataclass(frozen=True)
class Link:
    key: str
    name: str
    bandwidth: float  # bytes/s a bulk transfer sustains


ACCELERATORS: dict[str, Accelerator] = {
    a.key: a
    for a in (
        Accelerator("h100-sxm", "H100 SXM", 989 * TERA, 80 * GIB, 3.35 * TERA),
        Accelerator("h200", "H200", 989 * TERA, 141 * GIB, 4.8 * TERA),
        Accelerator("a100-80gb", "A100 80GB", 312 * TERA, 80 * GIB, 2.039 * TERA),
        Accelerator("l40s", "L40S", 362 * TERA, 48 * GIB, 0.864 * TERA),
    )
}

LINKS: tuple[Link, ...] = (
    Link("pcie4", "PCIe Gen4 x16", 25e9),
    Link("pcie5", "PCIe Gen5 x16", 50e9),
    Link("nvme4", "NVMe Gen4", 5e9),
    Link("nvme5", "NVMe Gen5", 14e9),
    Link("100gbe", "100 GbE", 12.5e9),
    Link("400gbe", "400 GbE", 50e9),
)


def get_accelerator(key: str) -> Accelerator:
    try:
        return ACCELERATORS[key.lower()]
    except KeyError:
        raise KvtierError(f"unknown hardware {key!r}; presets: {', '.join(ACCELERATORS)}") from None


def transfer_seconds(nbytes: float, bandwidth: float) -> float:
    """Time to move `nbytes` at a sustained `bandwidth` (bytes/s); latency is ignored because
    a whole sequence's KV is megabytes to tens of gigabytes."""
    return nbytes / bandwidth
