"""int4 draft weights through a small native kernel on CPUs with AVX-512 VNNI (``native/q4_vnni.c``).

PyTorch's CPU int4 matmul unpacks each weight to a float: on one Zen 4 core it ran a one-token step's 121 weight
matmuls (SmolLM2) in ~9 ms, reading ~84 MB of packed weights at ~10 GB/s where the core reads memory at ~27 GB/s.
This kernel splits each row of activations per group of 32 into two int8 parts (whole steps of max |x| / 127, and
what that leaves in 254ths of a step: ~16 bits) and multiplies 16 rows by 4 weights in one instruction
(``vpdpbusd``), every product exact: the lean forward's one-token step took 12.1 ms against 14.8 there (README "The
int4 kernel"). The weights are quantized as ``quantized.Int4Weight`` quantizes them (``quantized.int4_levels``),
their scales kept in float32 (PyTorch's kernel rounds scales and activations to bfloat16). It is a draft: the kernel
moves how often a draft token is accepted (``bench/draft_dtypes.py``), never the output.

The kernel is built with the system C compiler on first use, into the cache dir, once per source; where
there is no compiler, no AVX-512 VNNI or the build fails, ``available()`` is False and int4 weights use PyTorch's
kernel (``quantized.Int4Weight``). ``SPECSPLIT_INT4_KERNEL=torch`` asks for PyTorch's kernel anyway.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

import torch

from draft_service.quantized import INT4_GROUP, int4_levels

log = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).parent / "native" / "q4_vnni.c"
FLAGS = ("avx512f", "avx512bw", "avx512_vnni")  # /proc/cpuinfo's names for what the kernel uses
CFLAGS = ("-O3", "-shared", "-fPIC", "-mavx512f", "-mavx512bw", "-mavx512vnni", "-mfma")
KERNEL_ENV = "SPECSPLIT_INT4_KERNEL"  # "torch": PyTorch's int4 kernel even where this one runs
GROUP = INT4_GROUP  # weights sharing a scale and a low value along a row
BLOCK = 16  # rows a kernel block holds, one a 32-bit lane


def _cpu_flags() -> set[str]:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built kernel (built now if it is not in the cache dir yet), or None where it cannot run here."""
    if os.environ.get(KERNEL_ENV, "").strip().lower() == "torch":
        return None
    if not set(FLAGS) <= _cpu_flags():
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        log.info("int4 draft weights: no C compiler, PyTorch's int4 kernel is used")
        return None
    from specsplit.models import cache_dir

    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    path = cache_dir() / "native" / f"q4_vnni-{key}.so"
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # built aside, then moved in whole
                built = pathlib.Path(tmp) / path.name
                subprocess.run([compiler, *CFLAGS, str(SOURCE), "-o", str(built), "-lm"], check=True,
                               capture_output=True, timeout=120)
                os.replace(built, path)
        except (OSError, subprocess.SubprocessError) as err:
            detail = getattr(err, "stderr", b"") or b""
            log.warning("int4 draft weights: building %s failed (%s %s); PyTorch's int4 kernel is used", SOURCE.name,
                        err, detail.decode(errors="replace")[-500:])
            return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as err:  # (a file left broken by something else: removed, so the next start builds it again)
        log.warning("int4 draft weights: cannot load %s (%s); PyTorch's int4 kernel is used", path, err)
        path.unlink(missing_ok=True)
        return None
    lib.q4_vnni_matmul.restype = ctypes.c_int
    lib.q4_vnni_matmul.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 3
    return lib


def available(device: torch.device | str = "cpu") -> bool:
    """Whether int4 weights run through this kernel here: a CPU with AVX-512 VNNI and a C compiler that built it."""
    return torch.device(device).type == "cpu" and _library() is not None


def fits(rows: int, cols: int) -> bool:
    """Whether an [rows, cols] weight packs into the kernel's blocks."""
    return rows % BLOCK == 0 and cols % GROUP == 0


@dataclass(frozen=True)
class VnniInt4Weight:
    """A linear's weight in int4 groups, in the kernel's layout (see ``native/q4_vnni.c``)."""

    levels: torch.Tensor  # [N/16, K/32, 4, 16, 4] uint8: two 4-bit levels a byte
    scales: torch.Tensor  # [N/16, K/32, 16] float32
    lows: torch.Tensor  # [N/16, K/32, 16] float32: each group's value at level 0
    shape: tuple[int, int]  # (N, K)

    @staticmethod
    def of(weight: torch.Tensor) -> "VnniInt4Weight":
        rows, cols = weight.shape
        groups = cols // GROUP
        levels, scale, low = int4_levels(weight, GROUP)  # [N, K/G, G], [N, K/G, 1], [N, K/G, 1]
        # a group's 32 levels as 4 runs of 8: byte i of run j holds levels 8j + i and 8j + 4 + i
        runs = levels.view(rows // BLOCK, BLOCK, groups, 4, 8)  # [N/16, 16, K/G, 4, 8]
        packed = runs[..., :4] | (runs[..., 4:] << 4)  # [N/16, 16, K/G, 4, 4]
        packed = packed.permute(0, 2, 3, 1, 4).contiguous()  # [N/16, K/G, 4, 16, 4]

        def blocked(t: torch.Tensor) -> torch.Tensor:  # [N, K/G, 1] -> [N/16, K/G, 16]
            return t.view(rows // BLOCK, BLOCK, groups).transpose(1, 2).contiguous()

        return VnniInt4Weight(packed, blocked(scale), blocked(low), (rows, cols))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [Q, K] -> [Q, N] in float32."""
        rows, cols = self.shape
        x = x.float().contiguous()  # [Q, K]
        out = torch.empty(x.shape[0], rows, dtype=torch.float32)  # [Q, N]
        done = _library().q4_vnni_matmul(self.levels.data_ptr(), self.scales.data_ptr(), self.lows.data_ptr(),
                                         x.data_ptr(), out.data_ptr(), x.shape[0], rows, cols)
        if done != 0:
            raise ValueError(f"int4 kernel: a [{rows}, {cols}] weight does not fit its blocks")
        return out
