"""The half draft's precisions, measured on the machine it runs on: which dtype runs a one-token draft step
fastest, and which runs many-token forwards (a prompt, a copied span) fastest.

No one precision wins on every CPU. On the CPU of bench/results/drafters_half.md (1 thread, SmolLM2):
float16 steps 18.5 ms vs float32 37.8 ms, and a 40-token forward 443 ms in float16 vs 51 ms in bfloat16.
On an AVX2-only EPYC (no 16-bit matrix units; 1 thread, /tmp/probe*.py of the 2026-11-30 session): steps
float32 174 ms, float16 108 ms, bfloat16 94 ms; a 165-token prompt float32 1.0 s, float16 4.8 s, bfloat16
5.4 s. So the half draft times each candidate once at start and keeps the fastest for each kind of forward.
Whatever it picks, the output is unchanged: the target verifies in its own dtype.

A CPU with PyTorch's weight-only int8 matmul also times int8 weights for steps (``lean.Int8Weight``), kept only
when clearly the fastest (``pick_step_dtype``): on a Sapphire Rapids CPU (``bench/draft_dtypes.py``, 1 thread,
SmolLM2, a step on a 200-token cache) float32 51 ms, float16 54, bfloat16 50, int8 33 ms, with greedy agreement
with the float32 target of 99.8% (float16), 98.4% (bfloat16) and 97.7% (int8): two or three more rejected tokens a
hundred, for a third off every step.

On a CPU, a Llama-architecture target's copies run the lean forward (draft_service/lean.py): weights in the
candidate dtype, activations and one shared KV cache in float32, so the step and many-token copies never
cast the cache. Measured on the AVX2 EPYC (1 thread, SmolLM2, a step on a 200-token cache, medians of six
interleaved rounds, /tmp/probe/cmp.py of the 2026-11-30 fourth session): Hugging Face bfloat16 86 ms; lean
float32 99, bfloat16 68, float16 64 ms; greedy agreement with the float32 target over 384 chat positions
bfloat16 99.0%, float16 100%.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass

import torch

from draft_service import lean
from specsplit import kvcache
from specsplit.models import resolve_dtype
from specsplit.runner import ModelRunner

log = logging.getLogger(__name__)

STEP_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # one-token steps: the cheapest wins
if lean.int8_available():
    STEP_DTYPES += (torch.int8,)  # int8 weights (lean forwards only)
INT8_MIN_SPEEDUP = 1.25  # int8 steps are kept only this much faster than the fastest other dtype (pick_step_dtype)
MANY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # prompts and copied spans
MANY_TOKENS = 16  # a timed many-token forward (a copied span's length); timed steps run on a cache this long


@dataclass(frozen=True)
class Calibration:
    step_dtype: torch.dtype
    many_dtype: torch.dtype
    step_ms: dict  # dtype -> ms of one step on a MANY_TOKENS cache (only the timed ones)
    many_ms: dict  # dtype -> ms of a MANY_TOKENS forward on a MANY_TOKENS cache

    def describe(self) -> str:
        def fmt(times: dict) -> str:
            return ", ".join(f"{str(d).removeprefix('torch.')} {ms:.1f} ms" for d, ms in times.items())

        return (f"steps in {str(self.step_dtype).removeprefix('torch.')} ({fmt(self.step_ms) or 'as asked'}); "
                f"{MANY_TOKENS}-token forwards in {str(self.many_dtype).removeprefix('torch.')} ({fmt(self.many_ms)})")


def calibrate(model, threads: int = 0, step_dtypes=STEP_DTYPES, many_dtypes=MANY_DTYPES,
              repeats: int = 3, lean_forward: bool = True) -> tuple[dict, Calibration]:
    """Copies of ``model`` in each candidate dtype, timed on this machine with ``threads`` torch threads (the
    draft's own). Returns ({dtype: model} holding the chosen ones only, the calibration). A single step
    candidate is taken as given (not timed). On a GPU nothing is timed: float16 (or the one given) for both.
    On a CPU the copies of a model ``lean.supports`` are lean forwards (``weight_dtype`` = the candidate)
    unless ``lean_forward`` is False (Hugging Face models wanted: HF assisted generation's assistant)."""
    if model.device.type != "cpu":
        dtype = step_dtypes[0] if len(step_dtypes) == 1 else torch.float16
        return {dtype: model if model.dtype == dtype else copy.deepcopy(model).to(dtype)}, Calibration(dtype, dtype, {}, {})
    if lean_forward and lean.supports(model):
        models = {dtype: lean.LeanLlama(model, dtype) for dtype in dict.fromkeys((*step_dtypes, *many_dtypes))}
    else:
        if torch.int8 in step_dtypes:
            if len(step_dtypes) == 1:
                raise ValueError("int8 draft weights need the lean forward (a Llama-architecture model on a CPU)")
            step_dtypes = tuple(d for d in step_dtypes if d != torch.int8)
        models = {dtype: model if model.dtype == dtype else copy.deepcopy(model).to(dtype)
                  for dtype in dict.fromkeys((*step_dtypes, *many_dtypes))}
    timed = list(dict.fromkeys((*step_dtypes, *many_dtypes))) if len(step_dtypes) + len(many_dtypes) > 2 else []
    runner = ModelRunner("calibrate", threads)
    try:
        times = {d: runner(_time, models[d], repeats) for d in timed}  # dtype -> (step ms, many-token ms)
    finally:
        runner.close()
    step_ms = {d: times[d][0] for d in step_dtypes} if len(step_dtypes) > 1 else {}
    many_ms = {d: times[d][1] for d in many_dtypes} if len(many_dtypes) > 1 else {}
    step = pick_step_dtype(step_ms) if step_ms else step_dtypes[0]
    many = min(many_ms, key=many_ms.get) if many_ms else many_dtypes[0]
    calibration = Calibration(step, many, step_ms, many_ms)
    log.info("half draft: %s", calibration.describe())
    return {d: models[d] for d in (step, many)}, calibration


def pick_step_dtype(step_ms: dict) -> torch.dtype:
    """The step dtype to keep from the timed ones ({dtype: ms}): the fastest, except that int8 weights, whose greedy
    tokens agree with the target's less often (97.7% against float16's 99.8% on the Sapphire Rapids CPU), must beat
    the fastest other dtype by INT8_MIN_SPEEDUP: a draft chain of 8 tokens is accepted whole ~16% less often."""
    fastest = min(step_ms, key=step_ms.get)
    others = {d: ms for d, ms in step_ms.items() if d != torch.int8}
    if fastest == torch.int8 and others:
        best_other = min(others, key=others.get)
        if step_ms[torch.int8] * INT8_MIN_SPEEDUP > others[best_other]:
            return best_other
    return fastest


def parse_draft_dtype(name: str | None) -> tuple[torch.dtype, ...]:
    """--draft-dtype for the half draft: the step dtypes to time (auto/empty: all of STEP_DTYPES) or the one
    named (a float dtype, or int8)."""
    if name in (None, "", "auto"):
        return STEP_DTYPES
    if name == "int8":
        return (torch.int8,)
    return (resolve_dtype(name),)


def weight_dtype(model) -> torch.dtype:
    """The dtype a draft copy keeps its weights in (a lean forward computes in float32 whatever they are)."""
    return getattr(model, "weight_dtype", model.dtype)


def _time(model, repeats: int) -> tuple[float, float]:
    """(fastest of ``repeats`` one-token steps, one MANY_TOKENS-token forward), both on a MANY_TOKENS cache
    made by an untimed forward first (which also warms the kernels up)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 2 * MANY_TOKENS + 1), generator=generator)  # [1, 2M+1]
    ids = ids.to(model.device)
    cache = kvcache.new_cache(model)
    key = kvcache.cache_kwarg(model)
    model(input_ids=ids[:, :MANY_TOKENS], use_cache=True, logits_to_keep=1, **{key: cache})
    step = float("inf")
    for _ in range(repeats):
        kvcache.truncate(cache, MANY_TOKENS)
        start = time.perf_counter()
        model(input_ids=ids[:, MANY_TOKENS:MANY_TOKENS + 1], use_cache=True, **{key: cache})
        step = min(step, (time.perf_counter() - start) * 1e3)
    kvcache.truncate(cache, MANY_TOKENS)
    start = time.perf_counter()
    model(input_ids=ids[:, MANY_TOKENS:2 * MANY_TOKENS], use_cache=True, **{key: cache})
    return step, (time.perf_counter() - start) * 1e3
