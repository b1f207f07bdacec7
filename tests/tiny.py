"""Tiny random-weight Llama models and a byte-level tokenizer, built in code (no files, no downloads).

SPECSPLIT_TEST_DEVICE=cuda puts the tiny models (and the HF greedy references) on a GPU, so the parity
and concurrency tests check the verifier's CUDA paths: e.g.
``SPECSPLIT_TEST_DEVICE=cuda pytest tests/parity/test_batched_engine.py tests/integration/test_concurrency.py``.
"""

from __future__ import annotations

import os
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specsplit.models import LoadedModel, tokenizer_fingerprint

VOCAB = 320  # 256 byte tokens + 3 specials + padding ids the tokenizer never produces
EOS_ID = 257
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def tiny_tokenizer(extra: str = "") -> PreTrainedTokenizerFast:
    """Byte-level tokenizer over the whole tiny vocabulary; ``extra`` changes the vocab (a different tokenizer)."""
    byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
    byte_chars.sort()
    vocab = {ch: i for i, ch in enumerate(byte_chars)}  # 256 entries
    vocab.update({"<unk>": 256, "</s>": EOS_ID, "<s>": 258})
    for i in range(len(vocab), VOCAB):
        vocab[f"<extra_{i}{extra}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", bos_token="<s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama(seed: int = 0, layers: int = 2, hidden: int = 64, eos: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=258, eos_token_id=EOS_ID if eos else None, pad_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    # Random init gives near-uniform logits; sharpen them so argmax is decisive, as in a trained model.
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = EOS_ID
    return model


DEVICE = os.environ.get("SPECSPLIT_TEST_DEVICE", "cpu")


def tiny_loaded(seed: int = 0, layers: int = 2, name: str = "", eos: bool = True, tokenizer=None) -> LoadedModel:
    tok = tokenizer or tiny_tokenizer()
    return LoadedModel(tiny_llama(seed, layers, eos=eos).to(DEVICE), tok, name or f"tiny-llama-{seed}", tokenizer_fingerprint(tok))


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The reference: Hugging Face generate(do_sample=False) of the target alone."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids], device=model.device), do_sample=False,
                             max_new_tokens=max_new_tokens,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=model.device))
    return out[0, len(prompt_ids):].tolist()


def tiny_eagle(target: LoadedModel, seed: int = 1, noise: float = 0.05, head_ids=None, config=None):
    """A FeatureProposer around a randomly perturbed drafter built from ``target`` (manifest names it)."""
    from draft_service.feature_proposer import FeatureProposer
    from specsplit.heads import FeatureDrafter, Manifest
    from specsplit.models import target_identity

    torch.manual_seed(seed)
    drafter = FeatureDrafter.init_from_target(target.model, head_ids)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad:
                p.add_(noise * torch.randn_like(p))
    manifest = Manifest("eagle", f"tiny-eagle-{seed}", target_identity(target), target.fingerprint,
                        drafter.manifest_config())
    return FeatureProposer(drafter.eval(), manifest, config)


def tiny_medusa(target: LoadedModel, num_heads: int = 3, seed: int = 1, top_k: int = 3, max_nodes: int = 16):
    """A MedusaProposer with random heads over ``target``."""
    from specsplit.heads import MedusaHeads
    from verifier_service.medusa import MedusaProposer

    torch.manual_seed(seed)
    heads = MedusaHeads(target.model.config.hidden_size, num_heads)
    with torch.no_grad():
        for block in heads.blocks:
            block.weight.normal_(0, 0.05)
    return MedusaProposer(heads.eval(), target.model.get_output_embeddings(), top_k, max_nodes, "tiny-medusa")


PARITY_PROMPTS = [  # short, repetitive (n-gram matches), long, one token
    [258, 72, 101, 108, 108, 111],
    [258, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4],
    list(range(30, 90)),
    [42],
]


def generate_through(stack, prompt_ids: list[int], max_new_tokens: int, draft: str = "auto"):
    """Generate through the stack's orchestrator over gRPC: (tokens, round stats, chunks).

    A seed makes the draft budgets follow acceptance alone (no wall-clock costs), so the trees drafted
    do not depend on how busy the machine is; greedy output does not depend on the seed at all.
    """
    from specsplit.client import Client

    chunks = list(Client(stack.address).generate(prompt_token_ids=prompt_ids, max_new_tokens=max_new_tokens,
                                                 draft=draft, seed=0))
    return [t for c in chunks for t in c.token_ids], [c.stats for c in chunks if c.stats is not None], chunks


def span_exporter():
    """An in-memory exporter of this process's spans from now on (the SDK tracer provider is set if nobody
    set one yet; OpenTelemetry allows setting it only once)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def before_each_forward(engine, monkeypatch, action) -> None:
    """Run ``action()`` on a verifier engine's model thread as each packed forward starts (to hold it, or fail it)."""
    forward = engine._forward

    def wrapped(*args, **kwargs):
        action()
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine, "_forward", wrapped)


def hold_each_forward(engine, monkeypatch, seconds: float = 0.02) -> None:
    """Make each verifier forward take ``seconds`` longer, so provisional tokens always arrive during a verification
    (a verifier as fast as the draft leaves a run now and then without any)."""
    before_each_forward(engine, monkeypatch, lambda: time.sleep(seconds))


def wait_for(predicate, timeout: float = 5.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` s pass; its last value (for work that finishes in the
    background: a Release call, a sweep)."""
    deadline = time.time() + timeout
    while not predicate() and time.time() < deadline:
        time.sleep(0.02)
    return predicate()


def delay_relay(upstream: str, rtt_ms: float):
    """The benchmark's delaying TCP relay (``bench/relay.py``) on a free loopback port in front of ``upstream``:
    every call through it pays a true TCP round trip of ``rtt_ms``. A context manager; ``.address`` to dial."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    from relay import DelayRelay

    return DelayRelay("127.0.0.1:0", upstream, rtt_ms=rtt_ms)
