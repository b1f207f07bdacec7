"""Self-speculation inside the verifier: Medusa heads turn the last cached feature into a proposal tree.

After a session's Prefill or Verify the verifier holds f_t, the target's feature at the last cached
position t; its own LM head has just turned it into x_{t+1}, the pending token (the next tree's root).
Head k (0-based) predicts x_{t+2+k}: the root's descendants at depth k+1. The tree takes the heads'
top-k tokens along a fixed sparse shape (``sparse_tree_paths``), built once: a path [r_1, ..., r_d]
is the node whose depth-j token is head j-1's rank-r_j choice. The candidates are a deterministic
function of the committed tokens (and, sampled by coupled draws, of the seed: the heads' tokens are ranked by their
coupled scores), so one-hot q keeps greedy and sampled acceptance exact.
"""

from __future__ import annotations

import itertools
import pathlib

import torch
from torch import nn

from specsplit.errors import FailedPrecondition, InvalidArgument
from specsplit.heads import ARTIFACTS_DIR, MedusaHeads, check_manifest, load_artifact, read_manifest
from specsplit.sampling import SamplingParams, scores
from specsplit.tree import TokenTree

RANK_WEIGHTS = (0.6, 0.15, 0.08, 0.05, 0.03, 0.02, 0.01, 0.01)  # rough P(accept) of a head's rank-r token
DEPTH_DECAY = 0.8  # later heads are less accurate


def sparse_tree_paths(num_heads: int, top_k: int, max_nodes: int) -> list[tuple[int, ...]]:
    """The ``max_nodes`` most likely paths of ranks by a fixed prior, prefix-closed, parents before children."""
    top_k = min(top_k, len(RANK_WEIGHTS))
    scored = []
    for depth in range(1, num_heads + 1):
        for path in itertools.product(range(top_k), repeat=depth):
            prior = 1.0
            for j, rank in enumerate(path):
                prior *= RANK_WEIGHTS[rank] * DEPTH_DECAY ** j
            scored.append((-prior, depth, path))
    scored.sort()
    return [path for _, _, path in scored[:max_nodes]]  # a prefix scores >= its extensions: prefix-closed


class MedusaProposer:
    def __init__(self, heads: MedusaHeads, lm_head: nn.Module, top_k: int = 4, max_nodes: int = 32, name: str = ""):
        self.heads, self.lm_head, self.name = heads.eval(), lm_head, name
        self.paths = sparse_tree_paths(heads.num_heads, top_k, max_nodes)  # built once
        self.top_k = top_k
        index = {path: i for i, path in enumerate(self.paths)}
        self.parents = tuple(index[p[:-1]] if len(p) > 1 else -1 for p in self.paths)  # [N]
        self.max_nodes = len(self.paths)

    @torch.inference_mode()
    def propose(self, feature: torch.Tensor, sampling: SamplingParams = SamplingParams(), position: int = 0
                ) -> TokenTree:
        """feature: [H] the target's feature at the last cached position -> the next Verify's tree. position: the
        sequence index of head 0's token (the committed tokens' count, the pending one included): a session sampled
        by coupled draws ranks each head's tokens by their coupled scores there (``specsplit.sampling.scores``)."""
        w = self.lm_head.weight
        logits = self.lm_head(self.heads(feature.to(w.dtype)[None])[:, 0])  # [K, V]
        logits = scores(logits, sampling, [position + k for k in range(len(logits))])  # [K, V]
        ranked = logits.topk(self.top_k, dim=-1).indices.tolist()  # [K, k]
        tokens = tuple(ranked[len(p) - 1][p[-1]] for p in self.paths)  # [N]
        return TokenTree(tokens, self.parents, (1.0,) * len(tokens))


def find_artifact(kind: str, target_identity: str, tokenizer_fingerprint: str,
                  root: pathlib.Path | None = None) -> pathlib.Path | None:
    """The shipped artifact of ``kind`` for this target with the best measured tau (None: none ships)."""
    root = ARTIFACTS_DIR if root is None else root
    best, best_tau = None, -1.0
    for manifest_path in sorted(root.glob("*/manifest.json")) if root.is_dir() else []:
        try:
            manifest = read_manifest(manifest_path.parent)
            check_manifest(manifest, target_identity, tokenizer_fingerprint)
        except (InvalidArgument, FailedPrecondition):
            continue
        if manifest.kind != kind:
            continue
        tau = measured_tau(manifest.measured)
        if tau > best_tau:
            best, best_tau = manifest_path.parent, tau
    return best


def measured_tau(measured: dict) -> float:
    """One number from a manifest's ``measured`` block: tau, or the mean of tau by prompt kind."""
    tau = measured.get("tau", 0.0) if measured else 0.0
    if isinstance(tau, dict):
        return sum(tau.values()) / len(tau) if tau else 0.0
    return float(tau or 0.0)


def load_medusa(path: str | pathlib.Path | None, loaded, top_k: int = 4, max_nodes: int = 32) -> MedusaProposer:
    """Medusa heads for ``loaded`` (a LoadedModel): from ``path``, or the shipped artifact for this target."""
    from specsplit.models import target_identity

    identity = target_identity(loaded)
    if not path:
        path = find_artifact("medusa", identity, loaded.fingerprint)
        if path is None:
            raise FailedPrecondition(f"no shipped Medusa artifact for target {identity}; give --medusa PATH")
    manifest = read_manifest(path)
    if manifest.kind != "medusa":
        raise InvalidArgument(f"{path} is a {manifest.kind} artifact, not medusa")
    check_manifest(manifest, identity, loaded.fingerprint)
    model = loaded.model
    heads, _ = load_artifact(path, model.get_input_embeddings().weight, device=model.device, dtype=model.dtype)
    return MedusaProposer(heads, model.get_output_embeddings(), top_k, max_nodes, manifest.name)
