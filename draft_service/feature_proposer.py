"""The EAGLE-style feature drafter on the edge: a tree from one decoder layer over the target's features.

The verifier sends f_t, the target's feature of every committed position t it caches (``specsplit.features``);
with the committed tokens x that makes the drafter's rows: row t reads (f_t, x_{t+1}) and predicts
f_{t+1}. A session keeps the drafter's K/V of those committed rows. With L committed tokens the verifier
has cached positions 0..L-2, so the last row is t = L-2: it predicts f_{L-1}, whose logits give the
root's children (candidates for x_L). Each deeper level feeds the drafter's own predicted feature back:
a node at depth d (token at position L-1+d) is a row reading (the feature predicted for its parent's
position, its token), one forward per depth for the whole frontier, with a tree mask over the cache.
The tree's rows are dropped afterwards; only committed rows stay. Streamed rounds (``grow``, greedy or coupled)
grow the same rows width-adaptively and keep the provisional path's rows for the next round's seed.

Greedy targets get a deterministic top-k tree with one-hot q (coupled draws: the same on the rows' coupled
scores, ``specsplit.sampling``); rejection sampling gets children drawn i.i.d. from q over the drafter's (possibly
pruned) vocabulary, sent with the target's token ids.

Features may arrive with a gap (the draft restarted, the session moved to another verifier replica by
import): the drafter then starts its cache afresh at the first position it has; overlapping rows are
skipped. Either way only the draft's quality changes: the verifier decides every token.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from draft_service.rounds import GrowthControl, GrowthRound, draft_sampling, grow_top_tree, growth_policy
from specsplit.config import DraftConfig
from specsplit.errors import InvalidArgument
from specsplit.features import Features
from specsplit.heads import KV, FeatureDrafter, Manifest, check_manifest, load_artifact, read_manifest
from specsplit.provisional import reconcile_provisional
from specsplit.runner import ModelRunner
from specsplit.sampling import SamplingParams, distribution, round_seed, scores
from specsplit.tree import GrowthStep, SparseDist, TokenTree


@dataclass
class _FeatureSession:
    sampling: SamplingParams  # the target's; q mirrors it (truncated to q_top_k ids)
    generator: torch.Generator | None
    start: int = -1  # position of cached row 0 (-1: no features yet)
    past: KV | None = None  # the drafter's K/V of the cached rows: [1, H_kv, R, D] each
    last_out: torch.Tensor | None = None  # [H] predicted feature of position start + R (from the last row)
    pending: list[Features] = field(default_factory=list)  # received, not yet run through the drafter
    # The last DraftTree round's provisional path (best verified branch + provisional tokens), drafted after
    # `path_base` committed tokens, with the drafter rows of its nodes but the last (rows predicted then,
    # over the committed rows of then: a draft's approximation, as every tree row is).
    path_base: int = 0
    path_tokens: list[int] = field(default_factory=list)  # [P]
    path_probs: list[float] = field(default_factory=list)  # [P]
    path_kv: KV | None = None  # [1, H_kv, P', D] each, P' <= P - 1 rows of the path's first nodes
    path_out: torch.Tensor | None = None  # [P', H] the feature each of those rows predicted

    @property
    def num_rows(self) -> int:
        return 0 if self.past is None else int(self.past[0].shape[2])

    @property
    def received_end(self) -> int:
        """One past the last position whose feature this session has (cached or pending)."""
        return self.start + self.num_rows + sum(f.num_positions for f in self.pending)


class FeatureProposer:
    name = "eagle"
    wants_features = True

    def __init__(self, drafter: FeatureDrafter, manifest: Manifest, config: DraftConfig | None = None):
        self.drafter = drafter.eval()
        # [V', H] the head's rows, gathered once (drafter.logits would gather V' x H floats every call)
        self.head = drafter.embed.weight[drafter.vocab_ids].detach().contiguous()
        self.manifest = manifest
        self.artifact = manifest.name
        self.config = config or DraftConfig()
        self.tokenizer_fingerprint = manifest.tokenizer_fingerprint
        self.target_identity = manifest.target_identity
        self._sessions: dict[str, _FeatureSession] = {}
        self._runner = ModelRunner("eagle", self.config.threads)

    def start(self, session_id: str, prompt_token_ids: list[int], sampling: SamplingParams | None = None) -> None:
        sampling, generator = draft_sampling(sampling, self.config.q_top_k)
        self._sessions[session_id] = _FeatureSession(sampling, generator)

    def end(self, session_id: str, idle=None) -> None:
        self._sessions.pop(session_id, None)

    def add_features(self, session_id: str, chunks: list[Features]) -> None:
        """Queue newly committed positions' features; skip overlap, restart the cache after a gap."""
        session = self._sessions[session_id]
        for chunk in chunks:
            if chunk.hidden_size != self.drafter.config.hidden_size:
                raise InvalidArgument(f"features have hidden size {chunk.hidden_size}; this drafter reads "
                                      f"{self.drafter.config.hidden_size}")
            expected = session.received_end
            if session.start < 0 or chunk.first_position > expected:
                session.start, session.past, session.last_out, session.pending = chunk.first_position, None, None, [chunk]
            elif chunk.end_position > expected:
                skip = expected - chunk.first_position
                session.pending.append(Features(expected, chunk.values[skip:]))

    def propose(self, session_id: str, token_ids: list[int], max_nodes: int, stop_token_ids=()) -> TokenTree:
        return self._runner(self._propose, self._sessions[session_id], token_ids, max_nodes, frozenset(stop_token_ids))

    def grow(self, session_id: str, token_ids: list[int], max_nodes: int, control: GrowthControl,
             provisional_max: int = 0, stop_token_ids=()) -> Iterator[GrowthStep]:
        """One DraftTree round (greedy or coupled draws): stream a width-adaptive tree as it grows, then draft provisionally
        from the best verified branch's leaf (``GrowthRound``). Kept provisional tokens seed the next
        round's tree with their rows from this round. Coupled draws: the same on ``sampling.scores``. Rejection
        sampling: the Propose path's tree, in one step."""
        session = self._sessions[session_id]
        if session.sampling.rejection_sampled:
            tree = self.propose(session_id, token_ids, max_nodes, stop_token_ids)
            yield GrowthStep(0, tree.token_ids, tree.parents, tree.draft_probs, done=True)
            return
        committed = len(token_ids)
        self._runner(self._catch_up, session, token_ids)
        if session.last_out is None or session.start + session.num_rows != committed - 1:
            session.path_tokens = []
            yield GrowthStep(0, (), (), (), done=True)  # no features yet, or they lag the tokens
            return
        seed, tree_kv, predicted = self._kept_provisional(session, token_ids)
        slot = {node: node for node in range(len(seed) - 1)}  # node -> its row among the tree rows
        session.path_tokens, session.path_probs, session.path_kv, session.path_out = [], [], None, None

        def forward(tree, nodes: list[int], stop=None) -> torch.Tensor:
            """[F, V'] the drafter's next-token logits of each node; one drafter forward for the non-root ones (one
            layer: run whole, whatever ``stop`` says)."""
            run = [n for n in nodes if n >= 0]
            tokens = TokenTree(tuple(tree.token_ids), tuple(tree.parents))

            def on_model_thread() -> torch.Tensor:
                nonlocal tree_kv
                if run:
                    out, tree_kv = self._expand(session, committed, tokens, run, predicted, slot, tree_kv)  # [F, H]
                    predicted.update(zip(run, out))
                return self._scores(session, torch.stack([predicted[n] for n in nodes]), committed,
                                    [0 if n < 0 else tokens.depths[n] for n in nodes])  # [F, H] -> [F, V']

            return self._runner(on_model_thread)

        def forget(num_verified: int) -> None:
            for node in [n for n in slot if n >= num_verified]:
                del slot[node]
                predicted.pop(node, None)

        round_ = GrowthRound(forward, forget, self.drafter.vocab_ids)
        try:
            yield from round_.run(seed, max_nodes, growth_policy(self.config, stop_token_ids), control,
                                  provisional_max)
        finally:
            self._keep_path(session, committed, round_, slot, tree_kv, predicted)

    def _kept_provisional(self, session: _FeatureSession, token_ids: list[int]):
        """Last round's provisional tokens that continue ``token_ids`` as (token, prob) seed nodes, the tree
        rows of all but the last ([1, H_kv, S-1, D] each, or None) and node -> predicted feature
        (-1: the root's, from the committed rows)."""
        predicted: dict[int, torch.Tensor] = {-1: session.last_out}
        base, path = session.path_base, session.path_tokens
        kept = reconcile_provisional(token_ids[base:], path) if path and len(token_ids) > base else []
        skip = len(path) - len(kept)  # path nodes now committed
        rows = 0 if session.path_out is None else session.path_out.shape[0]
        if not kept or skip + len(kept) - 1 > rows:
            return [], None, predicted
        n = len(kept) - 1
        tree_kv = None if n == 0 else tuple(t[:, :, skip:skip + n] for t in session.path_kv)
        for node in range(n):
            predicted[node] = session.path_out[skip + node]  # [H]
        return list(zip(kept, session.path_probs[skip:])), tree_kv, predicted

    def _keep_path(self, session: _FeatureSession, committed: int, round_: GrowthRound, slot: dict[int, int],
                   tree_kv: KV | None, predicted: dict[int, torch.Tensor]) -> None:
        """Remember the provisional path and the rows of its first nodes that have one (in path order)."""
        tree = round_.tree
        path = tree.path_to(round_.leaf) if 0 <= round_.leaf < len(tree) else []
        with_rows = []
        for node in path:
            if node not in slot or tree_kv is None:
                break
            with_rows.append(node)
        session.path_base = committed
        session.path_tokens = [tree.token_ids[n] for n in path]
        session.path_probs = [tree.draft_probs[n] for n in path]
        if with_rows:
            index = torch.tensor([slot[n] for n in with_rows])  # [P']
            session.path_kv = tuple(t.index_select(2, index) for t in tree_kv)
            session.path_out = torch.stack([predicted[n] for n in with_rows])  # [P', H]

    # -- the model thread -------------------------------------------------------------------------------
    def _propose(self, session: _FeatureSession, token_ids: list[int], max_nodes: int,
                 stop: frozenset[int] = frozenset()) -> TokenTree:
        committed = len(token_ids)
        self._catch_up(session, token_ids)
        if max_nodes <= 0 or session.last_out is None or session.start + session.num_rows != committed - 1:
            return TokenTree.empty()  # no features yet, or they lag the tokens: nothing to draft from
        if session.generator is not None and session.sampling.seed is not None:  # same draws on any restart
            session.generator.manual_seed(round_seed(session.sampling.seed, committed, stream=1))
        sampled = session.sampling.rejection_sampled
        top_k = self.config.model_top_k
        predicted: dict[int, torch.Tensor] = {-1: session.last_out}  # node -> [H] feature its row predicted
        tree_kv: KV | None = None  # the tree rows' K/V, [1, H_kv, T, D]
        slot: dict[int, int] = {}  # node -> its row among the tree rows

        def expand(tree: TokenTree, frontier: list[int]) -> torch.Tensor:
            nonlocal tree_kv
            out, tree_kv = self._expand(session, committed, tree, frontier, predicted, slot, tree_kv)  # [F, H]
            for row, node in enumerate(frontier):
                predicted[node] = out[row]  # [H]
            return self._scores(session, out, committed, [tree.depths[n] for n in frontier])  # [F, V']

        if sampled:
            children = lambda logits, frontier, cum: self._sampled_children(session, logits, frontier, cum)  # noqa: E731
        else:
            children = lambda logits, frontier, cum: self._top_children(logits, frontier, cum, top_k)  # noqa: E731
        return grow_top_tree(self._scores(session, session.last_out[None], committed, [0]), children, expand,
                             max_nodes, self.config.model_depth, top_k, sampled, stop)

    def _logits(self, features: torch.Tensor) -> torch.Tensor:
        """[F, H] -> [F, V'] what ``FeatureDrafter.logits`` computes, over the pre-gathered head."""
        return features @ self.head.T

    def _scores(self, session: _FeatureSession, features: torch.Tensor, committed: int, depths: list[int]
                ) -> torch.Tensor:
        """[F, H] -> [F, V'] the rows' logits, or with coupled draws their scores (``sampling.scores``; row f picks
        the token at position committed + depths[f], its node's depth, 0 for the root)."""
        return scores(self._logits(features), session.sampling, [committed + d for d in depths], self.drafter.vocab_ids)

    def _catch_up(self, session: _FeatureSession, token_ids: list[int]) -> None:
        """Run the pending feature rows (t, x_{t+1}) on top of the cached ones."""
        if not session.pending:
            return
        features = torch.cat([f.values for f in session.pending]).float()  # [M, H]
        first = session.pending[0].first_position
        usable = min(features.shape[0], len(token_ids) - 1 - first)  # row t needs x_{t+1}
        if usable <= 0:
            return
        rest = features[usable:]
        session.pending = [Features(first + usable, rest.half())] if len(rest) else []
        features = features[:usable]
        positions = torch.arange(first + 1, first + 1 + usable)[None]  # [1, M] position of x_{t+1}
        next_tokens = torch.tensor([token_ids[first + 1:first + 1 + usable]])  # [1, M]
        past = session.past
        allowed = None
        if past is not None:
            cached = session.num_rows
            allowed = torch.ones(usable, cached + usable, dtype=torch.bool).tril(diagonal=cached)[None, None]  # [1, 1, M, R+M]
        out, kv = self.drafter(features[None], next_tokens, positions, allowed, past)  # [1, M, H]
        session.past = kv if past is None else (torch.cat([past[0], kv[0]], 2), torch.cat([past[1], kv[1]], 2))
        session.last_out = out[0, -1]  # [H]

    def _expand(self, session: _FeatureSession, committed: int, tree: TokenTree, frontier: list[int],
                predicted: dict[int, torch.Tensor], slot: dict[int, int], tree_kv: KV | None) -> tuple[torch.Tensor, KV]:
        """One drafter row per frontier node over the committed rows and the node's ancestors' rows.

        Every ancestor of a frontier node was itself a frontier node at a smaller depth, so it has a row."""
        cached = session.num_rows
        used = 0 if tree_kv is None else int(tree_kv[0].shape[2])  # tree rows so far (some may be cut nodes')
        for node in frontier:
            slot[node] = used
            used += 1
        allowed = torch.zeros(len(frontier), cached + used, dtype=torch.bool)  # [F, R+T]
        allowed[:, :cached] = True
        for row, node in enumerate(frontier):
            for ancestor in tree.path_to(node):
                allowed[row, cached + slot[ancestor]] = True
        past = session.past if tree_kv is None else tuple(torch.cat([c, t], 2) for c, t in zip(session.past, tree_kv))
        features = torch.stack([predicted[tree.parents[n]] for n in frontier])[None]  # [1, F, H]
        ids = torch.tensor([[tree.token_ids[n] for n in frontier]])  # [1, F]
        positions = torch.tensor([[committed - 1 + tree.depths[n] for n in frontier]])  # [1, F]
        out, kv = self.drafter(features, ids, positions, allowed[None, None], past)  # [1, F, H]
        tree_kv = kv if tree_kv is None else (torch.cat([tree_kv[0], kv[0]], 2), torch.cat([tree_kv[1], kv[1]], 2))
        return out[0], tree_kv

    def _top_children(self, logits, frontier, cum, top_k):
        """Deterministic: each frontier node's top-k tokens, greedy chain first, then by cumulative prob."""
        probs = logits.softmax(dim=-1)  # [F, V']
        values, indices = probs.topk(min(top_k, probs.shape[-1]), dim=-1)  # [F, k]
        token_ids = self.drafter.vocab_ids[indices]  # [F, k] target ids
        candidates = []
        for row, parent in enumerate(frontier):
            base = 1.0 if parent < 0 else cum[parent]
            for rank in range(indices.shape[1]):
                q = float(values[row, rank])
                if q > 0.0:  # (a token the request's top-k or top-p cut has none: coupled scores of -inf)
                    candidates.append((base * q, parent, int(token_ids[row, rank]), q, None, row == 0 and rank == 0))
        candidates.sort(key=lambda c: (not c[5], -c[0]))
        return [c[:5] for c in candidates]

    def _sampled_children(self, session, logits, frontier, cum):
        """Sampling: each frontier node's children are k i.i.d. draws from q (over the drafter's vocabulary)."""
        q_rows = distribution(logits, session.sampling)  # [F, V']
        vocab_ids = self.drafter.vocab_ids  # [V']
        candidates = []
        for row, parent in enumerate(frontier):
            base = 1.0 if parent < 0 else cum[parent]
            q = q_rows[row]  # [V']
            support = q.nonzero().flatten()  # [S]
            dist = SparseDist(tuple(vocab_ids[support].tolist()), tuple(q[support].tolist()))
            draws = torch.multinomial(q, self.config.model_top_k, replacement=True, generator=session.generator)
            for index in draws.tolist():
                candidates.append((base * float(q[index]), parent, int(vocab_ids[index]), float(q[index]), dist))
        return candidates


def load_target_tensors(target_dir: str | pathlib.Path) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's token embedding [V, H] and final norm weight [H], read alone from its safetensors."""
    from safetensors import safe_open

    embed = norm = None
    for path in sorted(pathlib.Path(target_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            if "model.embed_tokens.weight" in keys:
                embed = f.get_tensor("model.embed_tokens.weight")
            if "model.norm.weight" in keys:
                norm = f.get_tensor("model.norm.weight")
    if embed is None:
        raise InvalidArgument(f"{target_dir}: no model.embed_tokens.weight in its *.safetensors")
    return embed.float(), None if norm is None else norm.float()


def load_feature_proposer(artifact: str | pathlib.Path | None, target_model: str | None,
                          config: DraftConfig | None = None) -> FeatureProposer:
    """The feature drafter for ``target_model`` (default: SmolLM2-135M-Instruct): ``artifact``, or the
    shipped eagle artifact with the best measured tau for it. Refuses an artifact of another target."""
    from specsplit.models import load_tokenizer, model_path, tokenizer_fingerprint
    from verifier_service.medusa import find_artifact

    identity = target_identity_of(target_model)
    fingerprint = tokenizer_fingerprint(load_tokenizer(target_model))
    if not artifact:
        artifact = find_artifact("eagle", identity, fingerprint)
        if artifact is None:
            raise InvalidArgument(f"no shipped eagle artifact for target {identity}; give --draft-artifact PATH")
    manifest = read_manifest(artifact)
    if manifest.kind != "eagle":
        raise InvalidArgument(f"{artifact} is a {manifest.kind} artifact, not eagle")
    check_manifest(manifest, identity, fingerprint)
    embed, _ = load_target_tensors(model_path(target_model))
    drafter, manifest = load_artifact(artifact, embed)
    return FeatureProposer(drafter, manifest, config)


def target_identity_of(target_model: str | None) -> str:
    """specsplit.models.target_identity of a target, without loading it when it is the default one."""
    from specsplit.models import DEFAULT_GGUF_SHA256, DEFAULT_TARGET, is_default_target, load_model, target_identity

    if is_default_target(target_model):
        return f"{DEFAULT_TARGET}@gguf-sha256:{DEFAULT_GGUF_SHA256}"
    return target_identity(load_model(target_model, "cpu", "float32"))
