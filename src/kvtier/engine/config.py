"""EngineConfig: every knob of the serving engine, validated once at construction."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from kvtier.errors import KvtierError
from kvtier.setting_doc import setting

if TYPE_CHECKING:
    from kvtier.compress.config import CompressionConfig
    from kvtier.host_cpu import HostCpu

Priority = Literal["decode_first", "prefill_first"]
DType = Literal["auto", "bfloat16", "float32"]
DTYPES = ("auto", "bfloat16", "float32")
DTYPE_HELP = (
    "auto (default: bfloat16 on CUDA and on a CPU with AVX512_BF16 or AMX, float32 elsewhere), "
    "bfloat16 or float32"
)
KVQuant = Literal["int8", "int4", "int2"]
PrefillAttention = Literal["auto", "kernel", "torch"]
PREFILL_ATTENTIONS = ("auto", "kernel", "torch")

_GIB = 1 << 30


@dataclass
class EngineConfig:
    """Settings of one Engine.

    `kv_cache_bytes` is the device KV pool budget: the pool holds
    `kv_cache_bytes // bytes_per_block` blocks and never grows. `max_num_batched_tokens` is the
    per-step token budget shared by decodes and prefill chunks (chunked prefill). `namespace`
    is the model part of every block key; by default it is derived from the model folder so
    two different models never share keys (tenants add their salt per request).
    """

    model_dir: str | Path | None = None  # None: the embedded SmolLM2
    # "auto": bfloat16 where the hardware multiplies it natively (CUDA; a CPU with AVX512_BF16
    # or AMX), float32 elsewhere; see `resolved_dtype`. The engine runs on the resolved one.
    dtype: DType = "auto"
    device: str | None = None  # None: cuda when available, else cpu
    block_size: int = setting(
        16, help="tokens per KV block, the unit of the prefix cache", kind="int"
    )
    kv_cache_bytes: int = setting(
        _GIB, help="the device KV pool; it never grows", kind="size", flag=True
    )
    max_num_batched_tokens: int = setting(
        512,
        help="tokens one step computes, decodes and prefill chunks together (chunked prefill)",
        kind="int",
        flag=True,
    )
    max_num_seqs: int = setting(
        64, help="requests running at once; the rest wait", kind="int", flag=True
    )
    priority: Priority = setting(
        "decode_first",
        help="who gets a step's tokens first: running decodes or waiting prefills",
        kind="string",
        choices=("decode_first", "prefill_first"),
    )
    enable_prefix_caching: bool = True
    namespace: str | None = None
    num_threads: int | None = None  # None: all cores
    max_model_len: int | None = setting(
        None,
        help="the longest sequence, prompt and output",
        kind="int",
        default_text="the model's context (`max_position_embeddings`)",
        flag=True,
    )
    session_resume_after_s: float = setting(
        30.0,
        help="a conversation's turn after a pause this long counts as resumed (its KV was "
        "paused, not running)",
        kind="number",
        flag=True,
    )
    # the session tracker's bound (engine/sessions.py)
    max_sessions: int = setting(
        10_000,
        help="conversations remembered; beyond, the least recently active is forgotten, its KV "
        "with it",
        kind="int",
    )
    # KV compression (kvtier.compress): a pipeline of presses applied to each request once
    # its prompt is prefilled. None (or ratio 0 everywhere) leaves the KV untouched.
    compression: CompressionConfig | None = None
    # Storage form of the device KV pool (like vLLM's kv_cache_dtype): None keeps the model
    # dtype; "int8" / "int4" / "int2" store every full block packed, KIVI's axes (keys per
    # channel over the block's tokens, values per token over `kv_quant_group` channels),
    # the partial last block of each sequence in full precision. The same kv_cache_bytes
    # then holds more blocks. Fixed for the engine's life (see engine/quant_pool.py).
    kv_quant: KVQuant | None = None
    kv_quant_group: int = 32
    # Fault the KV pool's pages in on a low-priority background thread after start-up
    # (engine/prefault.py): no start-up latency, and the first restores into blocks no
    # request has written yet stop paying the page faults (the first host restore took
    # 2.4-2.6x as long as later ones). The price: the whole budget becomes resident memory
    # within seconds of start rather than as it fills, and the kernel's work in the
    # background: 0.12 s of CPU to 3.7 s of wall time per GiB on this VM (more when the
    # hypervisor backs fresh guest memory on first touch).
    prefault_kv_pool: bool = True
    # Decodes on CPU read K/V straight from the pool (engine/paged_decode.py, a C++ kernel
    # built at engine start: no gather, no padded copy) instead of gather + one padded SDPA
    # call; 1.2-1.5x faster decode at 8K. Its bf16 attention rows differ in the last bits
    # from prefill's, which once made turns resumed from KV that decodes wrote answer
    # otherwise than recomputed; with one-row matmuls computed as two (llama.Linear) the
    # restore tests hold with it on (benchmarks/records/2026-12-02-paged-decode-kernel.md).
    # Without a C++ compiler the engine logs it and keeps the gather; False keeps it too.
    paged_decode: bool = True
    # Who computes a bf16 prefill chunk's attention on the CPU (engine/attention.py
    # `_prefill_split`): kvtier's kernel (engine/prefill_attention.py: AVX512_BF16 dot
    # products, twice torch's flash attention on a CPU without AMX, a row's bits the same in
    # any chunk) or torch's flash attention, which on a CPU with AMX runs calls of at least 64
    # queries and keys on the AMX tiles; see `settle_prefill_attention`. The engine keeps
    # what runs.
    prefill_attention: PrefillAttention = setting(
        "auto",
        help="bf16 prefill attention on CPU: kernel (kvtier's, AVX512_BF16 dot products; a "
        "row's bits the same whatever chunk computes it), torch (torch's flash attention, on "
        "the AMX tiles where the CPU has them, in calls of 64 queries and keys or more) or "
        "auto (the kernel where it runs, torch's elsewhere)",
        kind="string",
        choices=PREFILL_ATTENTIONS,
        flag=True,
    )
    deterministic: bool = setting(
        False,
        help="every row's attention by one kernel whatever its batch, chunk or history: a "
        "turn restored from any tier, or batched, answers bit for bit as alone and recomputed "
        "(bf16 on CPUs with AVX512_BF16)",
        kind="bool",
        flag=True,
    )

    def __post_init__(self) -> None:
        _require_one_of("dtype", self.dtype, DTYPES)
        _require_one_of("prefill_attention", self.prefill_attention, PREFILL_ATTENTIONS)
        if self.device is not None and self.device.split(":")[0] not in ("cpu", "cuda"):
            raise KvtierError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        _require_one_of("priority", self.priority, ("decode_first", "prefill_first"))
        for name in (
            "block_size",
            "kv_cache_bytes",
            "max_num_batched_tokens",
            "max_num_seqs",
            "max_sessions",
        ):
            _require_positive_int(name, getattr(self, name))
        if self.kv_quant not in (None, "int8", "int4", "int2"):
            raise KvtierError(
                f"kv_quant must be 'int8', 'int4', 'int2' or None, got {self.kv_quant!r}"
            )
        _require_positive_int("kv_quant_group", self.kv_quant_group)
        if self.num_threads is not None:
            _require_positive_int("num_threads", self.num_threads)
        if self.max_model_len is not None:
            _require_positive_int("max_model_len", self.max_model_len)
        if not self.session_resume_after_s >= 0:
            raise KvtierError(
                f"session_resume_after_s must be >= 0, got {self.session_resume_after_s!r}"
            )

    def resolved_device(self) -> str:
        import torch

        if self.device is not None:
            if self.device.startswith("cuda") and not torch.cuda.is_available():
                raise KvtierError("device 'cuda' requested but torch sees no CUDA device")
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> Literal["bfloat16", "float32"]:
        """The dtype the engine runs, "auto" decided for `resolved_device()`."""
        return resolve_dtype(self.dtype, self.resolved_device())

    def resolved_num_threads(self) -> int:
        return self.num_threads or os.cpu_count() or 1


def resolve_dtype(
    dtype: str, device: str, cpu: HostCpu | None = None
) -> Literal["bfloat16", "float32"]:
    """`dtype` with "auto" decided for `device`: bfloat16 on CUDA and on a CPU with bf16 dot
    products (AVX512_BF16 or AMX), float32 on any other CPU. Without them torch emulates bf16
    matmuls: a SmolLM2 prefill of 512 tokens took 7.6 s in bfloat16 against 1.5 s in float32
    on an AVX2-only AMD EPYC. float32 KV takes twice the bytes a token, so the same
    `kv_cache_bytes` holds half the tokens."""
    if dtype == "bfloat16" or dtype == "float32":
        return dtype
    _require_one_of("dtype", dtype, DTYPES)
    if device.startswith("cuda"):
        return "bfloat16"
    from kvtier.host_cpu import host_cpu

    return "bfloat16" if (cpu or host_cpu()).native_bf16 else "float32"


def _require_one_of(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        allowed = ", ".join(f"'{c}'" for c in choices[:-1]) + f" or '{choices[-1]}'"
        raise KvtierError(f"{name} must be {allowed}, got {value!r}")


def _require_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise KvtierError(f"{name} must be a positive integer, got {value!r}")
