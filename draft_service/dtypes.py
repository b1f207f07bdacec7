"""The half draft's precisions, measured on the machine it runs on: which dtype runs a one-token draft step
fastest, which runs many-token forwards (a prompt, a copied span) fastest, and from how many tokens on the second
beats the first (``Calibration.many_from``).

No one precision wins on every CPU. On the CPU of bench/results/drafters_half.md (1 thread, SmolLM2):
float16 steps 18.5 ms vs float32 37.8 ms, and a 40-token forward 443 ms in float16 vs 51 ms in bfloat16.
On an AVX2-only EPYC (no 16-bit matrix units; 1 thread, /tmp/probe*.py of the 2026-11-30 session): steps
float32 174 ms, float16 108 ms, bfloat16 94 ms; a 165-token prompt float32 1.0 s, float16 4.8 s, bfloat16
5.4 s. So the half draft times each candidate once at start and keeps the fastest for each kind of forward.
Whatever it picks, the output is unchanged: the target verifies in its own dtype.

A CPU with PyTorch's int8 and int4 matmuls also times int8 and int4 weights for steps
(``draft_service/quantized.py``), each kept only when clearly the fastest (``pick_step_dtype``): on a Sapphire
Rapids CPU (``bench/draft_dtypes.py``, 1 thread, SmolLM2, a step on a 200-token cache) float32 51 ms, float16 54,
bfloat16 50, int8 33 ms, with greedy agreement with the float32 target of 99.8% (float16), 98.4% (bfloat16) and
97.7% (int8): two or three more rejected tokens a hundred, for a third off every step. On an AVX-512 EPYC float16
24.1 ms / 99.9%, int8 27.1 ms / 97.6%, int4 (groups of 32, the head rescored exactly) 17.0 ms / 99.4%.

On a CPU, a Llama-architecture target's copies run the lean forward (draft_service/lean.py): weights in the
candidate dtype, activations and one shared KV cache in float32, so the step and many-token copies never
cast the cache. Measured on the AVX2 EPYC (1 thread, SmolLM2, a step on a 200-token cache, medians of six
interleaved rounds, /tmp/probe/cmp.py of the 2026-11-30 fourth session): Hugging Face bfloat16 86 ms; lean
float32 99, bfloat16 68, float16 64 ms; greedy agreement with the float32 target over 384 chat positions
bfloat16 99.0%, float16 100%.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import logging
import os
import pathlib
import time
from dataclasses import dataclass, field

import torch

from draft_service import int4_kernel, lean
from draft_service.quantized import INT4, int4_available, int4_fits, int8_available
from specsplit import kvcache
from specsplit.models import resolve_dtype
from specsplit.runner import ModelRunner

log = logging.getLogger(__name__)

STEP_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # one-token steps: the cheapest wins
if int8_available():
    STEP_DTYPES += (torch.int8,)  # int8 weights (lean forwards only)
if int4_available():
    STEP_DTYPES += (INT4,)  # int4 weights (lean forwards only, rows in groups of 32)
QUANTIZED = (torch.int8, INT4)
# a quantized step dtype is kept only this much faster than the fastest float dtype (pick_step_dtype): its draft
# tokens agree with the target's less often (int8 97.6-97.7%, int4 99.4%, float16 99.8-99.9%)
MIN_SPEEDUP = {torch.int8: 1.25, INT4: 1.1}
MANY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # prompts and copied spans
MANY_TOKENS = 16  # a timed many-token forward (a copied span's length); timed steps run on a cache this long
MANY_FROM_MAX = 4 * MANY_TOKENS  # forwards of this many tokens go to the many-token dtype whatever the lines say
CALIBRATION_FILE = "draft-calibration.json"  # what calibrate timed, per machine (``remember``; the CLI's cache dir)
CALIBRATION_ENV = "SPECSPLIT_DRAFT_CALIBRATION"  # that file's path instead, or "off": time at every start


@dataclass(frozen=True)
class Calibration:
    step_dtype: torch.dtype
    many_dtype: torch.dtype
    step_ms: dict  # dtype -> ms of one step on a MANY_TOKENS cache (only the timed ones)
    many_ms: dict  # dtype -> ms of a MANY_TOKENS forward on a MANY_TOKENS cache
    recalled: str = ""  # "": timed now; else where and when these times were taken ("FILE, timed at ...")
    # the two chosen dtypes' (one-token step ms, MANY_TOKENS-token forward ms), whether or not they were candidates of
    # the other kind ({}: not timed): how many tokens a forward needs before the many-token dtype runs it faster
    lines: dict = field(default_factory=dict)

    def many_from(self) -> int | None:
        """The fewest tokens a forward has for the many-token dtype to run it: where a straight line through each
        chosen dtype's two timed forwards puts it below the step dtype's, at most MANY_FROM_MAX (past the timed
        sizes a line is a guess; prompts are longer). None: not timed (or one dtype for both).

        (Measured on a Xeon, 1 thread, SmolLM2 on a 200-token cache, by a one-off script on 2026-12-07: int4 23.5
        / 30.1 / 39.0 / 51.2 / 86.1 / 182.7 ms for 1 / 2 / 4 / 8 / 16 / 32 tokens, bfloat16 63.5 / 60.1 / 88.3 / 88.1
        / 110.6 / 209.2 ms: spans of 4-16 tokens, which went to bfloat16 from 4 tokens on, ran 1.3-2.3x slower there
        than in the int4 step dtype; these lines cross at 40 tokens.)"""
        step, many = self.lines.get(self.step_dtype), self.lines.get(self.many_dtype)
        if self.many_dtype == self.step_dtype or step is None or many is None:
            return None

        def ms(line: tuple[float, float], tokens: int) -> float:
            one, whole = line
            return one + (whole - one) * (tokens - 1) / (MANY_TOKENS - 1)

        return next((n for n in range(2, MANY_FROM_MAX) if ms(many, n) < ms(step, n)), MANY_FROM_MAX)

    def describe(self) -> str:
        def fmt(times: dict) -> str:
            return ", ".join(f"{dtype_name(d)} {ms:.1f} ms" for d, ms in times.items())

        many_from = self.many_from()
        return (f"steps in {dtype_name(self.step_dtype)} ({fmt(self.step_ms) or 'as asked'}); "
                f"{MANY_TOKENS}-token forwards in {dtype_name(self.many_dtype)} ({fmt(self.many_ms)})"
                + (f", from {many_from} tokens on" if many_from else "")
                + (f"; as timed before, kept in {self.recalled} (delete it to time again)" if self.recalled else ""))


def dtype_name(dtype: torch.dtype) -> str:
    """float16, bfloat16, float32, int8 or int4 (--draft-dtype's names)."""
    return "int4" if dtype == INT4 else str(dtype).removeprefix("torch.")


def calibrate(model, threads: int = 0, step_dtypes=STEP_DTYPES, many_dtypes=MANY_DTYPES,
              repeats: int = 5, lean_forward: bool = True, remember: pathlib.Path | None = None) -> tuple[dict, Calibration]:
    """Copies of ``model`` in each candidate dtype, timed on this machine with ``threads`` torch threads (the
    draft's own). Returns ({dtype: model} holding the chosen ones only, the calibration). A single step
    candidate is taken as given (not timed). On a GPU nothing is timed: float16 (or the one given) for both.
    On a CPU the copies of a model ``lean.supports`` are lean forwards (``weight_dtype`` = the candidate)
    unless ``lean_forward`` is False (Hugging Face models wanted: HF assisted generation's assistant).
    ``remember``: a JSON file of earlier calibrations; one of the same CPU, torch, threads, model shape and
    candidates is taken from it instead of timing (and only its two copies are made), a new one is added to it."""
    if model.device.type != "cpu":
        dtype = step_dtypes[0] if len(step_dtypes) == 1 else torch.float16
        return {dtype: model if model.dtype == dtype else copy.deepcopy(model).to(dtype)}, Calibration(dtype, dtype, {}, {})
    lean_here = lean_forward and lean.supports(model)
    unfit = () if lean_here else QUANTIZED
    unfit += (INT4,) if lean_here and not int4_fits(model) else ()
    if any(d in unfit for d in step_dtypes):
        if all(d in unfit for d in step_dtypes):
            raise ValueError(f"{dtype_name(step_dtypes[0])} draft weights need the lean forward (a Llama-architecture "
                             f"model on a CPU{', rows in groups of 32' if lean_here else ''})")
        step_dtypes = tuple(d for d in step_dtypes if d not in unfit)

    def copy_in(dtype: torch.dtype):
        if lean_here:
            return lean.LeanLlama(model, dtype)
        return model if model.dtype == dtype else copy.deepcopy(model).to(dtype)

    timed = list(dict.fromkeys((*step_dtypes, *many_dtypes))) if len(step_dtypes) + len(many_dtypes) > 2 else []
    key = _machine_key(model, threads, step_dtypes, many_dtypes, lean_here) if remember and timed else ""
    calibration = _recall(remember, key, step_dtypes, many_dtypes) if key else None
    if calibration is None:
        models = {dtype: copy_in(dtype) for dtype in dict.fromkeys((*step_dtypes, *many_dtypes))}
        runner = ModelRunner("calibrate", threads)
        try:
            times = {d: runner(_time, models[d], repeats) for d in timed}  # dtype -> (step ms, many-token ms)
        finally:
            runner.close()
        step_ms = {d: times[d][0] for d in step_dtypes} if len(step_dtypes) > 1 else {}
        many_ms = {d: times[d][1] for d in many_dtypes} if len(many_dtypes) > 1 else {}
        step = pick_step_dtype(step_ms) if step_ms else step_dtypes[0]
        many = min(many_ms, key=many_ms.get) if many_ms else many_dtypes[0]
        calibration = Calibration(step, many, step_ms, many_ms, lines={d: times[d] for d in (step, many) if d in times})
        if key:
            _remember(remember, key, calibration)
    else:
        models = {dtype: copy_in(dtype) for dtype in (calibration.step_dtype, calibration.many_dtype)}
    log.info("half draft: %s", calibration.describe())
    return {d: models[d] for d in (calibration.step_dtype, calibration.many_dtype)}, calibration


def calibration_file() -> pathlib.Path | None:
    """Where the services keep their calibrations: $SPECSPLIT_DRAFT_CALIBRATION (None if "off"), else the cache dir's
    CALIBRATION_FILE."""
    from specsplit.models import cache_dir

    where = os.environ.get(CALIBRATION_ENV, "").strip()
    if where.lower() == "off":
        return None
    return pathlib.Path(where) if where else cache_dir() / CALIBRATION_FILE


def _machine_key(model, threads: int, step_dtypes, many_dtypes, lean_here: bool) -> str:
    """What a calibration's times depend on: the CPU (its name and instruction-set flags), torch, the draft's
    threads, the model's shape (not its weights), the candidates and which kernel runs int4 weights."""
    cpu, flags = int4_kernel.cpu_info()
    config = model.config
    shape = [getattr(config, a, None) for a in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                 "num_attention_heads", "num_key_value_heads", "vocab_size")]
    return json.dumps([cpu, hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:16], torch.__version__,
                       threads or torch.get_num_threads(), shape, [dtype_name(d) for d in step_dtypes],
                       [dtype_name(d) for d in many_dtypes], lean_here]
                      + ([f"int4 {int4_kernel.kernel()}"] if INT4 in step_dtypes and int4_kernel.kernel() else []))


def _read(path: pathlib.Path) -> dict:
    try:
        known = json.loads(path.read_text())
        return known if isinstance(known, dict) else {}
    except (OSError, ValueError):  # none yet, or unreadable: time again (and write it anew)
        return {}


def _recall(path: pathlib.Path, key: str, step_dtypes, many_dtypes) -> Calibration | None:
    entry = _read(path).get(key)
    try:
        names = {dtype_name(d): d for d in (*step_dtypes, *many_dtypes)}
        return Calibration(names[entry["step"]], names[entry["many"]],
                           {names[n]: float(ms) for n, ms in entry["step_ms"].items()},
                           {names[n]: float(ms) for n, ms in entry["many_ms"].items()},
                           recalled=f"{path}, timed at {entry['timed_at']}",
                           lines={names[n]: (float(one), float(many)) for n, (one, many) in entry["lines"].items()})
    except (TypeError, KeyError, ValueError, AttributeError):  # no such entry, or one written before (or not by) this code
        return None


def _remember(path: pathlib.Path, key: str, calibration: Calibration) -> None:
    known = _read(path)
    known[key] = {"step": dtype_name(calibration.step_dtype), "many": dtype_name(calibration.many_dtype),
                  "step_ms": {dtype_name(d): ms for d, ms in calibration.step_ms.items()},
                  "many_ms": {dtype_name(d): ms for d, ms in calibration.many_ms.items()},
                  "lines": {dtype_name(d): list(line) for d, line in calibration.lines.items()},
                  "timed_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f".{path.name}.{os.getpid()}")
        scratch.write_text(json.dumps(known, indent=1))
        os.replace(scratch, path)  # whole or not at all, whoever else writes it
    except OSError as err:  # a read-only cache: time again next start
        log.warning("half draft: cannot keep the calibration in %s (%s)", path, err)


def pick_step_dtype(step_ms: dict) -> torch.dtype:
    """The step dtype to keep from the timed ones ({dtype: ms}): the fastest float dtype, unless a quantized one
    beats it by its MIN_SPEEDUP (the fastest such). Quantized draft tokens agree with the target's less often: with
    int8 (97.7% against float16's 99.8% on the Sapphire Rapids CPU) a draft chain of 8 tokens is accepted whole ~16%
    less often, with int4 (99.5%) ~3% less often."""
    floats = {d: ms for d, ms in step_ms.items() if d not in QUANTIZED}
    if not floats:
        return min(step_ms, key=step_ms.get)
    best = min(floats, key=floats.get)
    worth = {d: ms for d, ms in step_ms.items() if d in QUANTIZED and ms * MIN_SPEEDUP[d] <= floats[best]}
    return min(worth, key=worth.get) if worth else best


def parse_draft_dtype(name: str | None) -> tuple[torch.dtype, ...]:
    """--draft-dtype for the half draft: the step dtypes to time (auto/empty: all of STEP_DTYPES) or the one
    named (a float dtype, int8 or int4)."""
    if name in (None, "", "auto"):
        return STEP_DTYPES
    if name in ("int8", "int4"):
        return ({"int8": torch.int8, "int4": INT4}[name],)
    return (resolve_dtype(name),)


def weight_dtype(model) -> torch.dtype:
    """The dtype a draft copy keeps its weights in (a lean forward computes in float32 whatever they are)."""
    return getattr(model, "weight_dtype", model.dtype)


def _time(model, repeats: int) -> tuple[float, float]:
    """(fastest of ``repeats`` one-token steps, of two MANY_TOKENS-token forwards), both on a MANY_TOKENS cache
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
    many = float("inf")
    for _ in range(2):  # (the faster of two: one slow forward would move where the two dtypes' lines cross)
        kvcache.truncate(cache, MANY_TOKENS)
        start = time.perf_counter()
        model(input_ids=ids[:, MANY_TOKENS:2 * MANY_TOKENS], use_cache=True, **{key: cache})
        many = min(many, (time.perf_counter() - start) * 1e3)
    return step, many
