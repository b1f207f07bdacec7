"""The op-bound proxy target of the forward and scheduling benches (``forward_cost.py``, ``turnaround.py``), and
of the serving benches as the default target (``concurrency.py``, via a private cache):

    python bench/proxy.py DIR                 # DIR/<the default target's cache name>: the proxy, SmolLM2's tokenizer
    SPECSPLIT_CACHE=DIR python bench/concurrency.py --sessions 8 --threads 1 --model-cpus 0 --edge-cpus 1

A host-bound verifier on any CPU: what a GPU serving SmolLM2 looks like to the scheduler (a forward's cost flat in
its rows and tokens, set by the host issuing operations), so the batching and burst logic can be measured where
there is no GPU. Its tokens are not SmolLM2's; every method's tokens are still checked against HF greedy of it.
"""

from __future__ import annotations

import pathlib
import shutil
import sys

HERE = pathlib.Path(__file__).resolve().parent


def proxy_model(vocab_size: int = 320, scale: float = 1.0):
    """SmolLM2's depth and heads (30 layers, 9 query / 3 K/V heads) at hidden 72 (head size 8), random weights:
    every operation is tiny, so a forward costs what the host spends issuing operations -- what paces SmolLM2 on
    a GPU -- on any CPU. ``scale`` multiplies every weight: sharper logits, a model that repeats itself (as a
    trained one does on a code edit), so a lookup draft sometimes pays."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=72, intermediate_size=144, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(scale)
    return model


def install_proxy_target(cache: pathlib.Path) -> pathlib.Path:
    """Put the proxy (SmolLM2's vocabulary, weights x3) with SmolLM2's tokenizer where ``cache`` keeps the
    default target, so anything run with SPECSPLIT_CACHE=cache serves the proxy instead."""
    sys.path.insert(0, str(HERE.parent))
    from transformers import AutoConfig

    from specsplit import models

    source = models.default_target_dir()  # the real one, in the usual cache (built from the GGUF on first use)
    out = cache / models.DEFAULT_CACHE_NAME
    if out.resolve() == source.resolve():
        raise SystemExit(f"{cache} is the cache that holds the real target; name another directory")
    real = AutoConfig.from_pretrained(source)
    model = proxy_model(real.vocab_size, scale=3.0)
    model.generation_config.eos_token_id = real.eos_token_id
    model.save_pretrained(out)
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    (out / "complete").write_text("")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        raise SystemExit(__doc__)
    print(install_proxy_target(pathlib.Path(sys.argv[1])))
