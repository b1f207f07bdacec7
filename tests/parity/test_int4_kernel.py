"""int4 draft weights through the native kernel (draft_service/int4_kernel.py, native/q4.c).

Its layout holds the same int4 levels ``quantized.Int4Weight`` quantizes to (checked on any CPU); where the kernel
runs, its products are what its math says (activations per group of 32 as two int8 parts, int4 levels, float32
scales), its AVX-512 VNNI and AVX2 variants agree bit for bit, and the lean forward uses it for int4 weights; where
it does not, or a build fails, int4 weights stay PyTorch's.
"""

from __future__ import annotations

import logging

import pytest
import torch

from draft_service import int4_kernel, lean, quantized
from tiny import tiny_llama

KERNEL = pytest.mark.skipif(not int4_kernel.available(), reason="no AVX-512 VNNI or AVX2 (or no C compiler) here")
GROUP = int4_kernel.GROUP


def exact_in_int4(rows: int, cols: int, seed: int) -> torch.Tensor:
    """[rows, cols] weights whose every group of 32 is low + level * step, levels 0..15 with 0 and 15 present."""
    generator = torch.Generator().manual_seed(seed)
    levels = torch.randint(0, 16, (rows, cols // GROUP, GROUP), generator=generator)  # [N, K/G, G]
    levels[..., 3], levels[..., 17] = 0, 15
    low = torch.randn(rows, cols // GROUP, 1, generator=generator) * 0.1  # [N, K/G, 1]
    step = (torch.rand(rows, cols // GROUP, 1, generator=generator) + 0.1) * 0.02  # [N, K/G, 1]
    return (low + levels * step).view(rows, cols)


def unpacked(weight: int4_kernel.PackedInt4Weight) -> torch.Tensor:
    """The [N, K] weights the kernel's layout holds: level * scale + low."""
    rows, cols = weight.shape
    packed = weight.levels.permute(0, 3, 1, 2, 4)  # [N/16, 16, K/G, 4, 4]
    levels = torch.cat([packed & 0x0F, packed >> 4], dim=-1).reshape(rows, cols // GROUP, GROUP)  # [N, K/G, G]

    def rowwise(t: torch.Tensor) -> torch.Tensor:  # [N/16, K/G, 16] -> [N, K/G, 1]
        return t.transpose(1, 2).reshape(rows, cols // GROUP, 1)

    return (levels.float() * rowwise(weight.scales) + rowwise(weight.lows)).view(rows, cols)


def test_the_layout_holds_the_int4_levels():
    weight = exact_in_int4(48, 96, seed=1)
    packed = int4_kernel.PackedInt4Weight.of(weight)
    assert packed.levels.dtype == torch.uint8 and packed.levels.shape == (3, 3, 4, 16, 4)
    torch.testing.assert_close(unpacked(packed), weight, atol=1e-6, rtol=1e-5)
    rough = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))  # not exact: within half a step
    packed = int4_kernel.PackedInt4Weight.of(rough)
    steps = packed.scales.transpose(1, 2).reshape(32, 2, 1).expand(32, 2, GROUP).reshape(32, 64)
    assert bool(((unpacked(packed) - rough).abs() <= steps / 2 + 1e-6).all())
    assert int4_kernel.fits(48, 96) and not int4_kernel.fits(40, 96) and not int4_kernel.fits(48, 80)


def kernel_math(weight: int4_kernel.PackedInt4Weight, x: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in torch: each row of x ([Q, K]) per group as two int8 parts, steps of max|x| / 127
    and what rounding to them leaves in 254ths of a step."""
    rows, cols = weight.shape
    grouped = x.view(x.shape[0], cols // GROUP, GROUP)  # [Q, K/G, G]
    coarse = grouped.abs().amax(dim=-1, keepdim=True) / 127  # [Q, K/G, 1]
    high = torch.round(grouped / coarse)  # [Q, K/G, G]
    low = torch.round((grouped - high * coarse) / (coarse / 254)).clamp(-127, 127)  # [Q, K/G, G]
    rounded = high * coarse + low * (coarse / 254)  # [Q, K/G, G]
    return rounded.view_as(x).double() @ unpacked(weight).double().T  # [Q, N]


@KERNEL
@pytest.mark.parametrize("rows,cols", [(48, 96), (64, 1536)])
def test_the_kernel_computes_its_math(rows, cols):
    weight = exact_in_int4(rows, cols, seed=3)
    packed = int4_kernel.PackedInt4Weight.of(weight)
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(4))  # [Q, K]
    out = packed.matmul(x)  # [Q, N]
    assert out.dtype == torch.float32 and out.shape == (5, rows)
    torch.testing.assert_close(out.double(), kernel_math(packed, x), atol=1e-4, rtol=1e-4)
    exact = x @ weight.T  # [Q, N] the weights are exact in int4: only the activations' rounding is left (~16 bits)
    assert float((out - exact).norm() / exact.norm()) < 1e-4
    assert bool((packed.matmul(x[2:3]) == out[2:3]).all())  # a row's product does not depend on the others


@KERNEL
def test_the_lean_forward_runs_int4_weights_through_the_kernel():
    model = tiny_llama(seed=3, layers=2).eval()
    draft = lean.LeanLlama(model, quantized.INT4)
    assert isinstance(draft.layers[0].qkv, int4_kernel.PackedInt4Weight)
    assert isinstance(draft.head, quantized.RescoredHead)
    assert isinstance(draft.head.approx, int4_kernel.PackedInt4Weight)


def reset_kernel():
    int4_kernel._variant.cache_clear()
    int4_kernel._matmul.cache_clear()


@pytest.fixture
def fresh_kernel():
    reset_kernel()
    yield
    reset_kernel()


def runs(variant: str) -> bool:
    return set(int4_kernel.KERNELS[variant]) <= int4_kernel.cpu_info()[1]


@pytest.mark.skipif(not (runs("avx512vnni") and runs("avx2")), reason="needs a CPU with AVX-512 VNNI and AVX2")
def test_the_avx2_variant_gives_the_avx512_variants_floats(monkeypatch, fresh_kernel):
    weight = torch.randn(64, 1536, generator=torch.Generator().manual_seed(5))  # [N, K]
    packed = int4_kernel.PackedInt4Weight.of(weight)
    x = torch.randn(7, 1536, generator=torch.Generator().manual_seed(6)) * 3  # [Q, K]
    assert int4_kernel.kernel() == "avx512vnni"
    wide = packed.matmul(x)  # [Q, N]
    monkeypatch.setenv(int4_kernel.KERNEL_ENV, "AVX2")
    reset_kernel()
    assert int4_kernel.kernel() == "avx2"
    assert bool((packed.matmul(x) == wide).all())
    torch.testing.assert_close(wide.double(), kernel_math(packed, x), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not runs("avx2"), reason="no AVX2 here")
def test_a_variant_this_cpu_cannot_run_is_not_chosen(monkeypatch, fresh_kernel, caplog):
    monkeypatch.setattr(int4_kernel, "KERNELS", {"avx512vnni": ("no_such_flag",), "avx2": ("avx2", "fma")})
    monkeypatch.setenv(int4_kernel.KERNEL_ENV, "avx512vnni")
    with caplog.at_level(logging.WARNING, logger=int4_kernel.__name__):
        assert int4_kernel.kernel() == "avx2"
    assert "not a kernel this CPU runs (torch, avx2); using avx2" in caplog.text


@pytest.mark.skipif(not quantized.int4_available(), reason="no CPU int4 matmul in this torch")
def test_asked_for_pytorch_int4_weights_stay_pytorch(monkeypatch, fresh_kernel):
    monkeypatch.setenv(int4_kernel.KERNEL_ENV, "torch")
    assert not int4_kernel.available() and int4_kernel.kernel() is None
    draft = lean.LeanLlama(tiny_llama(seed=3, layers=1).eval(), quantized.INT4)
    assert isinstance(draft.layers[0].qkv, quantized.Int4Weight)


@pytest.mark.skipif(not runs("avx2"), reason="no AVX2 here")
def test_a_kernel_that_does_not_build_is_not_used(monkeypatch, tmp_path, fresh_kernel, caplog):
    broken = tmp_path / "q4.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(int4_kernel, "SOURCE", broken)
    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger=int4_kernel.__name__):
        assert not int4_kernel.available()
    assert "building q4.c failed" in caplog.text
    assert not list((tmp_path / "cache" / "native").glob("q4-*"))  # nothing half-built left for the next start


@pytest.mark.skipif(not runs("avx2"), reason="no AVX2 here")
def test_the_kernel_is_built_once_and_then_loaded(monkeypatch, tmp_path, fresh_kernel):
    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path / "cache"))
    assert int4_kernel.available()
    (built,) = (tmp_path / "cache" / "native").glob("q4-*")
    assert (built / "complete").exists() and (built / "q4.so").exists()

    def no_compiler(*args, **kwargs):
        raise AssertionError("the kernel was built again")

    monkeypatch.setattr(int4_kernel.subprocess, "run", no_compiler)
    reset_kernel()
    assert int4_kernel.available()  # the next process start loads what the first built
