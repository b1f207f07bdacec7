"""int4 draft weights through a small native kernel (``native/q4.c``): AVX-512 VNNI where the CPU has it, else AVX2.

PyTorch's CPU int4 matmul unpacks each weight to a float: on one Zen 4 core it ran a one-token step's 121 weight
matmuls (SmolLM2) in ~9 ms, reading ~84 MB of packed weights at ~10 GB/s where the core reads memory at ~27 GB/s.
This kernel splits each row of activations per group of 32 into two int8 parts (whole steps of max |x| / 127, and
what that leaves in 254ths of a step: ~16 bits) and multiplies them by the int4 levels in integer dot products
(``vpdpbusd``: 16 rows by 4 weights an instruction; on AVX2 ``vpmaddubsw``: 8 rows by 2), every product exact: the
lean forward's one-token step took 12.1 ms against 14.8 there (README "The int4 kernel"). Both variants read one
layout and give the same floats bit for bit. The weights are quantized as ``quantized.Int4Weight`` quantizes them
(``quantized.int4_levels``), their scales kept in float32 (PyTorch's kernel rounds scales and activations to
bfloat16). It is a draft: the kernel moves how often a draft token is accepted (``bench/draft_dtypes.py``), never
the output.

The kernel is built with the system C compiler on first use, into the cache dir, once per source; where there is no
compiler, neither instruction set or the build fails, ``available()`` is False and int4 weights use PyTorch's kernel
(``quantized.Int4Weight``). ``SPECSPLIT_INT4_KERNEL``: ``torch`` asks for PyTorch's kernel anyway, ``avx2`` for the
AVX2 variant on a CPU that also runs the AVX-512 one (to compare them).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
from dataclasses import dataclass

import torch

from draft_service.quantized import INT4_GROUP, int4_levels

log = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).parent / "native" / "q4.c"
# Each variant (its function q4_matmul_<name>) and the /proc/cpuinfo flags it needs, the preferred one first.
KERNELS = {"avx512vnni": ("avx512f", "avx512bw", "avx512_vnni", "fma"), "avx2": ("avx2", "fma")}
CFLAGS = ("-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno")  # (variants name their instruction sets)
KERNEL_ENV = "SPECSPLIT_INT4_KERNEL"  # "torch": PyTorch's int4 kernel; a variant's name: that one if it runs here
GROUP = INT4_GROUP  # weights sharing a scale and a low value along a row
BLOCK = 16  # rows a kernel block holds


@functools.cache
def cpu_info() -> tuple[str, frozenset[str]]:
    """This CPU's model name and instruction-set flags as /proc/cpuinfo has them (elsewhere: the platform's name and
    no flags)."""
    name, flags = "", ""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            name = name or (value.strip() if key.strip() == "model name" else "")
            flags = flags or (value.strip() if key.strip() == "flags" else "")
    except OSError:  # not Linux
        name = platform.processor()
    return name or platform.machine(), frozenset(flags.split())


def kernel() -> str | None:
    """The variant that runs int4 weights here, or None: PyTorch's kernel (asked for, no variant's instruction sets,
    no compiler or a failed build)."""
    return _variant() if _matmul() is not None else None


@functools.cache
def _variant() -> str | None:
    """The variant this CPU and ``SPECSPLIT_INT4_KERNEL`` choose (whether or not it builds)."""
    asked = os.environ.get(KERNEL_ENV, "").strip().lower()
    if asked == "torch":
        return None
    flags = cpu_info()[1]
    runs = [name for name, needs in KERNELS.items() if set(needs) <= flags]
    if asked and asked not in runs:
        log.warning("%s=%s: not a kernel this CPU runs (%s); using %s", KERNEL_ENV, asked,
                    ", ".join(["torch", *runs]), runs[0] if runs else "PyTorch's")
    return asked if asked in runs else (runs[0] if runs else None)


@functools.cache
def _matmul():
    """The chosen variant's function in the built kernel (built now if it is not in the cache dir yet), or None."""
    variant = _variant()
    if variant is None:
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        log.info("int4 draft weights: no C compiler, PyTorch's int4 kernel is used")
        return None
    from specsplit.models import built_once, cache_dir

    def build(staging: pathlib.Path) -> None:
        subprocess.run([compiler, *CFLAGS, str(SOURCE), "-o", str(staging / "q4.so"), "-lm"], check=True,
                       capture_output=True, timeout=120)

    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    try:
        built = built_once(cache_dir() / "native" / f"q4-{key}", build)
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", b"") or b""
        log.warning("int4 draft weights: building %s failed (%s %s); PyTorch's int4 kernel is used", SOURCE.name,
                    err, detail.decode(errors="replace")[-500:])
        return None
    try:
        function = getattr(ctypes.CDLL(str(built / "q4.so")), f"q4_matmul_{variant}")
    except (OSError, AttributeError) as err:  # (a build left broken by something else: removed, rebuilt next start)
        log.warning("int4 draft weights: cannot load %s (%s); PyTorch's int4 kernel is used", built, err)
        shutil.rmtree(built, ignore_errors=True)
        return None
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 3
    return function


def available(device: torch.device | str = "cpu") -> bool:
    """Whether int4 weights run through this kernel here: a CPU with AVX-512 VNNI or AVX2, and a C compiler that
    built it."""
    return torch.device(device).type == "cpu" and kernel() is not None


def fits(rows: int, cols: int) -> bool:
    """Whether an [rows, cols] weight packs into the kernel's blocks."""
    return rows % BLOCK == 0 and cols % GROUP == 0


@dataclass(frozen=True)
class PackedInt4Weight:
    """A linear's weight in int4 groups, in the kernel's layout (see ``native/q4.c``)."""

    levels: torch.Tensor  # [N/16, K/32, 4, 16, 4] uint8: two 4-bit levels a byte
    scales: torch.Tensor  # [N/16, K/32, 16] float32
    lows: torch.Tensor  # [N/16, K/32, 16] float32: each group's value at level 0
    shape: tuple[int, int]  # (N, K)

    @staticmethod
    def of(weight: torch.Tensor) -> "PackedInt4Weight":
        rows, cols = weight.shape
        groups = cols // GROUP
        levels, scale, low = int4_levels(weight, GROUP)  # [N, K/G, G], [N, K/G, 1], [N, K/G, 1]
        # a group's 32 levels as 4 runs of 8: byte i of run j holds levels 8j + i and 8j + 4 + i
        runs = levels.view(rows // BLOCK, BLOCK, groups, 4, 8)  # [N/16, 16, K/G, 4, 8]
        packed = runs[..., :4] | (runs[..., 4:] << 4)  # [N/16, 16, K/G, 4, 4]
        packed = packed.permute(0, 2, 3, 1, 4).contiguous()  # [N/16, K/G, 4, 16, 4]

        def blocked(t: torch.Tensor) -> torch.Tensor:  # [N, K/G, 1] -> [N/16, K/G, 16]
            return t.view(rows // BLOCK, BLOCK, groups).transpose(1, 2).contiguous()

        return PackedInt4Weight(packed, blocked(scale), blocked(low), (rows, cols))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [Q, K] -> [Q, N] in float32."""
        rows, cols = self.shape
        x = x.float().contiguous()  # [Q, K]
        out = torch.empty(x.shape[0], rows, dtype=torch.float32)  # [Q, N]
        done = _matmul()(self.levels.data_ptr(), self.scales.data_ptr(), self.lows.data_ptr(), x.data_ptr(),
                         out.data_ptr(), x.shape[0], rows, cols)
        if done != 0:
            raise ValueError(f"int4 kernel: a [{rows}, {cols}] weight does not fit its blocks")
        return out
