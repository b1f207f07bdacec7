"""Trained drafts for a target: the EAGLE-style feature drafter, Medusa heads, a distilled draft LM.

All three read the target's *features*: its final hidden state after the final norm, the vector its
LM head turns into logits. With f_t the feature at position t (it predicts token x_{t+1}):

- **FeatureDrafter** (EAGLE-style). Row t reads (f_t, x_{t+1}) -- fc([embed(x_{t+1}); f_t]) -> one
  Llama decoder layer with its own KV cache -> norm -- and predicts f_{t+1}, hence x_{t+2} through the
  target's (tied) LM head. Deeper tree levels feed its own predicted features back in. It runs on the
  edge; the verifier sends it the committed tokens' features in each Verify response.
- **MedusaHeads**: K residual blocks over f_t; head k's output through the target's LM head predicts
  x_{t+1+k}. They run inside the verifier (self-speculation, no draft service).
- **Draft LM** (``build_draft_lm``): the target's first N layers, distilled; an ordinary HF causal LM.

Token embeddings and the LM head are the target's own (frozen, tied), never stored in an artifact: an
artifact is the trained part only (fp16 safetensors) plus a manifest naming the exact target it was
trained for; ``check_manifest`` refuses any other pairing. The output head may score a frequency-pruned
vocabulary (``head_ids``): a cheaper draft; verification stays exact over the full vocabulary.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from specsplit.errors import FailedPrecondition, InvalidArgument
from specsplit.llama import kv_shape

ARTIFACTS_DIR = pathlib.Path(__file__).parent / "artifacts"  # the artifacts shipped with specsplit
# half: no weights of its own (the target itself at float16); its manifest records what was measured with which
# target, for --draft auto
KINDS = ("eagle", "medusa", "draft_lm", "half")
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"


# -- the manifest ------------------------------------------------------------------------------------
@dataclass
class Manifest:
    kind: str  # one of KINDS
    name: str  # the artifact's name (its directory under specsplit/artifacts)
    target_identity: str  # specsplit.models.target_identity() of the target it was trained for
    tokenizer_fingerprint: str  # specsplit.models.tokenizer_fingerprint() of that target's tokenizer
    config: dict = field(default_factory=dict)  # what rebuilds the module (see from_manifest)
    data: str = ""  # what it was trained on
    training: dict = field(default_factory=dict)  # seed, steps, lr, command, elapsed
    measured: dict = field(default_factory=dict)  # e.g. {"tau": {"chat": 2.1}, "per_depth_acceptance": [...]}

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        raw = json.loads(text)
        if raw.get("kind") not in KINDS:
            raise InvalidArgument(f"manifest kind {raw.get('kind')!r} is not one of {KINDS}")
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})


def check_manifest(manifest: Manifest, target_identity: str, tokenizer_fingerprint: str) -> None:
    """Refuse an artifact trained for another target (weights or tokenizer)."""
    if manifest.tokenizer_fingerprint != tokenizer_fingerprint:
        raise FailedPrecondition(
            f"draft artifact {manifest.name!r} was trained with tokenizer {manifest.tokenizer_fingerprint}, "
            f"the target uses {tokenizer_fingerprint}: its token ids mean other things; train one for this target"
        )
    if manifest.target_identity != target_identity:
        raise FailedPrecondition(
            f"draft artifact {manifest.name!r} was trained for target {manifest.target_identity}, not "
            f"{target_identity}: it reads that model's features; train one for this target"
        )


def save_artifact(directory: str | pathlib.Path, module: nn.Module, manifest: Manifest) -> pathlib.Path:
    """The module's own trained tensors in fp16 (frozen target tensors excluded) and the manifest."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float16 if v.is_floating_point() else v.dtype).contiguous()
               for k, v in trained_state(module).items()}
    save_file(tensors, str(directory / WEIGHTS))
    (directory / MANIFEST).write_text(manifest.to_json() + "\n")
    return directory


def read_manifest(directory: str | pathlib.Path) -> Manifest:
    path = pathlib.Path(directory) / MANIFEST
    if not path.is_file():
        raise InvalidArgument(f"{directory} is not a draft artifact (no {MANIFEST})")
    return Manifest.from_json(path.read_text())


def load_artifact(directory: str | pathlib.Path, target_embed: torch.Tensor, target_norm: torch.Tensor | None = None,
                  device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Manifest]:
    """Rebuild an artifact's module around the target's frozen tensors.

    target_embed: [V, H] the target's token embedding (= its tied LM head); target_norm: [H] its final
    norm weight (only the draft LM needs it). Check the manifest against the target first.
    """
    manifest = read_manifest(directory)
    module = from_manifest(manifest, target_embed, target_norm)
    state = load_file(str(pathlib.Path(directory) / WEIGHTS))
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in frozen_names(module)]
    if missing or unexpected:
        raise InvalidArgument(f"artifact {directory} does not fit a {manifest.kind}: missing {missing}, "
                              f"unexpected {unexpected}")
    return module.to(device=device, dtype=dtype).eval(), manifest


def from_manifest(manifest: Manifest, target_embed: torch.Tensor, target_norm: torch.Tensor | None = None) -> nn.Module:
    cfg = dict(manifest.config)
    if manifest.kind == "eagle":
        return FeatureDrafter(DrafterConfig(**cfg), target_embed)
    if manifest.kind == "medusa":
        return MedusaHeads(cfg["hidden_size"], cfg["num_heads"])
    return build_draft_lm(LlamaConfig(**cfg["llama"]), cfg["num_layers"], target_embed, target_norm)


def trained_state(module: nn.Module) -> dict[str, torch.Tensor]:
    frozen = frozen_names(module)
    return {k: v for k, v in module.state_dict().items() if k not in frozen}


def frozen_names(module: nn.Module) -> set[str]:
    """State-dict keys that come from the target, not from training."""
    return set(getattr(module, "FROZEN", ()))


# -- the EAGLE-style feature drafter -----------------------------------------------------------------
@dataclass
class DrafterConfig:
    hidden_size: int = 576  # the target's
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    max_position_embeddings: int = 8192
    vocab_size: int = 49152  # the target's
    head_vocab: int = 0  # 0: the head scores the full vocabulary; else the first head_vocab of head_ids

    @classmethod
    def of_target(cls, config, head_vocab: int = 0) -> "DrafterConfig":
        rope = getattr(config, "rope_parameters", None) or {}
        return cls(config.hidden_size, config.num_attention_heads, *kv_shape(config),
                   config.intermediate_size, config.rms_norm_eps,
                   float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
                   config.max_position_embeddings, config.vocab_size, head_vocab)

    def llama(self) -> LlamaConfig:
        return LlamaConfig(hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           intermediate_size=self.intermediate_size, rms_norm_eps=self.rms_norm_eps,
                           rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
                           max_position_embeddings=self.max_position_embeddings, vocab_size=self.vocab_size,
                           num_hidden_layers=1)


KV = tuple[torch.Tensor, torch.Tensor]  # keys, values: [B, H_kv, S, D]


class DecoderLayer(nn.Module):
    """A Llama decoder layer whose KV cache the caller holds (so a tree's rows can be dropped or kept)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.input_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config.llama())

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, allowed: torch.Tensor | None,
                past: KV | None = None) -> tuple[torch.Tensor, KV]:
        """x: [B, T, H]; cos, sin: [B, T, D]; allowed: [B, 1, T, S] bool (None: causal over the T rows,
        no past); past: keys/values [B, H_kv, P, D] with S = P + T. Returns [B, T, H] and this call's K/V."""
        B, T, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = self.k_proj(h).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, H_kv, T, D]
        v = self.v_proj(h).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, H_kv, T, D]
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, is_causal=allowed is None,
                                              enable_gqa=True)  # [B, H, T, D]
        x = x + self.o_proj(attn.transpose(1, 2).reshape(B, T, -1))
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, (k, v)


class FeatureDrafter(nn.Module):
    """EAGLE-style: predicts the target's next feature from (feature, next token); see the module doc."""

    FROZEN = ("embed.weight",)

    def __init__(self, config: DrafterConfig, target_embed: torch.Tensor, head_ids: torch.Tensor | None = None):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed = nn.Embedding.from_pretrained(target_embed.detach().float().clone(), freeze=True)  # [V, H]
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layer = DecoderLayer(config)
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(config.llama())
        if head_ids is None:
            head_ids = torch.arange(config.head_vocab or config.vocab_size)
        # [V'] target token ids the head scores, most frequent first; stored (trained choice), not frozen
        self.register_buffer("vocab_ids", head_ids.long().clone())

    def forward(self, features: torch.Tensor, token_ids: torch.Tensor, position_ids: torch.Tensor,
                allowed: torch.Tensor | None = None, past: KV | None = None) -> tuple[torch.Tensor, KV]:
        """features: [B, T, H] f_t; token_ids: [B, T] x_{t+1}; position_ids: [B, T] (t+1);
        allowed: [B, 1, T, P+T] bool or None (causal, no past); past: [B, H_kv, P, D] K/V.
        Returns predicted features [B, T, H] (f_{t+1}) and this call's K/V [B, H_kv, T, D]."""
        x = self.fc(torch.cat([self.embed(token_ids), features.to(self.fc.weight.dtype)], dim=-1))  # [B, T, H]
        cos, sin = self.rotary(x, position_ids)  # [B, T, D]
        x, kv = self.layer(x, cos, sin, allowed, past)
        return self.norm(x), kv

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """features: [..., H] -> [..., V'] scores over ``vocab_ids`` (the target's tied head, pruned)."""
        return features @ self.embed.weight[self.vocab_ids].T

    @classmethod
    def init_from_target(cls, target, head_ids: torch.Tensor | None = None, layer_idx: int = -1) -> "FeatureDrafter":
        """A drafter around ``target`` (an HF Llama causal LM): its embedding, its final norm, and one of its
        decoder layers as the starting point; fc starts as 'take the token embedding' plus a small feature term."""
        config = DrafterConfig.of_target(target.config, 0 if head_ids is None else len(head_ids))
        drafter = cls(config, target.get_input_embeddings().weight, head_ids)
        source = target.model.layers[layer_idx]
        drafter.layer.load_state_dict({k: v for k, v in source.state_dict().items()}, strict=False)
        drafter.norm.weight.data.copy_(target.model.norm.weight.data)
        with torch.no_grad():
            h = config.hidden_size
            drafter.fc.weight.zero_()
            drafter.fc.weight[:, :h] = torch.eye(h)
            drafter.fc.weight[:, h:] = 0.1 * torch.eye(h)
            drafter.fc.bias.zero_()
        return drafter

    def manifest_config(self) -> dict:
        return asdict(self.config)


# -- Medusa heads ------------------------------------------------------------------------------------
class MedusaHeads(nn.Module):
    """K residual blocks over the target's feature: head k (0-based) predicts x_{t+2+k} from f_t."""

    FROZEN = ()

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_heads))
        for block in self.blocks:  # start as the identity: every head first predicts what the LM head does
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features: [..., H] -> [K, ..., H]; the target's LM head turns each into logits."""
        return torch.stack([features + F.silu(block(features)) for block in self.blocks])

    def manifest_config(self) -> dict:
        return {"hidden_size": self.hidden_size, "num_heads": self.num_heads}


# -- the distilled draft LM --------------------------------------------------------------------------
class _DraftLM(LlamaForCausalLM):
    FROZEN = ("model.embed_tokens.weight", "lm_head.weight")


def build_draft_lm(config: LlamaConfig, num_layers: int, target_embed: torch.Tensor,
                   target_norm: torch.Tensor | None = None, target=None) -> LlamaForCausalLM:
    """An HF Llama with ``num_layers`` layers and the target's embedding/head (initialised from the
    target's first layers when ``target`` is given)."""
    config = LlamaConfig(**{**config.to_dict(), "num_hidden_layers": num_layers, "tie_word_embeddings": True})
    model = _DraftLM(config)
    model.model.embed_tokens.weight.data.copy_(target_embed)
    model.model.embed_tokens.weight.requires_grad_(False)
    model.tie_weights()
    if target_norm is not None:
        model.model.norm.weight.data.copy_(target_norm)
    if target is not None:
        for i in range(num_layers):
            model.model.layers[i].load_state_dict(target.model.layers[i].state_dict())
        model.model.norm.weight.data.copy_(target.model.norm.weight.data)
    return model.eval()


def draft_lm_manifest_config(model: LlamaForCausalLM) -> dict:
    cfg = model.config.to_dict()
    keep = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
            "rms_norm_eps", "rope_parameters", "max_position_embeddings", "vocab_size", "bos_token_id",
            "eos_token_id", "pad_token_id", "tie_word_embeddings", "hidden_act")
    return {"num_layers": model.config.num_hidden_layers, "llama": {k: cfg[k] for k in keep if k in cfg}}


# -- choosing a head vocabulary ----------------------------------------------------------------------
def frequent_ids(token_counts: torch.Tensor, size: int, always: list[int] = ()) -> torch.Tensor:
    """token_counts: [V] occurrences in the training data -> [size] ids, most frequent first (``always``
    -- e.g. EOS -- included)."""
    order = token_counts.argsort(descending=True).tolist()
    chosen = list(dict.fromkeys([*always, *order]))[:size]
    return torch.tensor(chosen, dtype=torch.long)
