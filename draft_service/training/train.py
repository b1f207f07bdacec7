"""Train a draft for the target on the data made by ``draft_service.training.generate_data``.

    python -m draft_service.training.train eagle    --out specsplit/artifacts/smollm2-135m-eagle
    python -m draft_service.training.train medusa   --out specsplit/artifacts/smollm2-135m-medusa
    python -m draft_service.training.train draft_lm --out specsplit/artifacts/smollm2-135m-draft2

Every run is seeded (same data + seed + flags -> same weights on the same machine), bounded by
``--max-minutes`` as well as ``--epochs``, holds out ``--val-fraction`` of the sequences and reports the
draft's agreement with the target's greedy tokens on them, per depth (what acceptance of a chain would
be). The artifact (fp16, trained tensors only) and its manifest (target identity, tokenizer fingerprint,
data description, training record, held-out agreement) go to ``--out``.

What each kind learns (f_t: the target's feature at t; g_t: the target's greedy next token at t):
- eagle: row t reads (f_t, x_{t+1}) and predicts f_{t+1} (smooth L1) and g_{t+1} (cross entropy over the
  pruned head vocabulary). A second, unrolled pass feeds the drafter's own predicted features back in
  (row t reads its prediction of f_t), as tree levels below the first do at inference.
- medusa: head k at t predicts x_{t+2+k} in the response (the target's greedy tokens), through the
  target's frozen LM head.
- draft_lm: the target's first ``--layers`` layers, trained to predict g_t at every position.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import sys
import time

import torch
import torch.nn.functional as F

from safetensors.torch import load_file

from draft_service.training.dataset import Sequence, load_sequences, read_description, shard_paths, split_shard
from specsplit.heads import (FeatureDrafter, Manifest, MedusaHeads, build_draft_lm, draft_lm_manifest_config,
                             frequent_ids, save_artifact)
from specsplit.models import load_model, target_identity

IGNORE = -100


# -- batches -----------------------------------------------------------------------------------------
def batches(seqs: list[Sequence], max_tokens: int, rng: random.Random) -> list[list[Sequence]]:
    """Length-sorted buckets of at most ``max_tokens`` padded tokens, in a shuffled order."""
    order = sorted(seqs, key=lambda s: len(s.token_ids))
    out, cur, longest = [], [], 0
    for s in order:
        n = len(s.token_ids)
        if cur and max(longest, n) * (len(cur) + 1) > max_tokens:
            out.append(cur)
            cur, longest = [], 0
        cur.append(s)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def pad(seqs: list[Sequence]) -> dict[str, torch.Tensor]:
    """Right-padded batch tensors; ``valid`` marks real positions, ``response`` response positions."""
    B, T = len(seqs), max(len(s.token_ids) for s in seqs)
    H = seqs[0].features.shape[1]
    token_ids = torch.zeros(B, T, dtype=torch.long)  # [B, T]
    target_next = torch.full((B, T), IGNORE, dtype=torch.long)  # [B, T]
    features = torch.zeros(B, T, H)  # [B, T, H]
    valid = torch.zeros(B, T, dtype=torch.bool)  # [B, T]
    response = torch.zeros(B, T, dtype=torch.bool)  # [B, T]
    for b, s in enumerate(seqs):
        n = len(s.token_ids)
        token_ids[b, :n] = s.token_ids.long()
        target_next[b, :n] = s.target_next.long()
        features[b, :n] = s.features.float()
        valid[b, :n] = True
        response[b, s.response_start:n] = True
    return {"token_ids": token_ids, "target_next": target_next, "features": features, "valid": valid,
            "response": response}


def remap(labels: torch.Tensor, vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Target ids -> indices into the pruned head vocabulary (IGNORE where pruned away or ignored)."""
    table = torch.full((vocab_size + 1,), IGNORE, dtype=torch.long)  # [V + 1]; the last entry for IGNORE
    table[vocab_ids] = torch.arange(len(vocab_ids))
    return table[torch.where(labels < 0, vocab_size, labels)]


# -- the three kinds ---------------------------------------------------------------------------------
class EagleTask:
    def __init__(self, target, vocab_ids: torch.Tensor, args):
        self.model = FeatureDrafter.init_from_target(target, vocab_ids)
        self.vocab_size = target.config.vocab_size
        self.unroll, self.ce_weight, self.noise = args.unroll, args.ce_weight, args.noise

    def losses(self, batch: dict, train: bool) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Rows t = 0..T-2 of every sequence. Returns the loss and per pass (correct, counted) top-1."""
        f = batch["features"]  # [B, T, H]
        B, T, _ = f.shape
        inputs = f[:, :-1]  # [B, T-1, H] f_t
        if train and self.noise:
            inputs = inputs + self.noise * torch.randn_like(inputs) * inputs.std()
        tokens = batch["token_ids"][:, 1:]  # [B, T-1] x_{t+1}
        positions = torch.arange(1, T)[None].expand(B, -1)  # [B, T-1]
        wanted = f[:, 1:]  # [B, T-1, H] f_{t+1}
        rows = batch["valid"][:, 1:]  # [B, T-1] rows whose x_{t+1} exists
        response = batch["response"]  # [B, T]
        label_in_response = torch.cat([response[:, 2:], response[:, -1:]], 1)  # [B, T-1] x_{t+2} is a response token
        judged = label_in_response & rows  # [B, T-1] drafting happens in the response: score those rows
        labels = remap(batch["target_next"][:, 1:][judged], self.model.vocab_ids, self.vocab_size)  # [R]
        loss, stats = 0.0, []
        for step in range(self.unroll):
            predicted, _ = self.model(inputs, tokens, positions)  # [B, T-1, H]
            regression = F.smooth_l1_loss(predicted[rows], wanted[rows])
            logits = self.model.logits(predicted[judged])  # [R, V'] only rows whose token is scored
            ce = F.cross_entropy(logits, labels, ignore_index=IGNORE)
            loss = loss + (regression + self.ce_weight * ce) / (step + 1)
            hit = (logits.argmax(-1) == labels) & (labels != IGNORE)
            stats.append((int(hit.sum()), len(labels)))
            # Next pass: row t reads the drafter's own prediction of f_t (row t-1's output), as deeper
            # tree levels do; row 0 keeps the true f_0.
            inputs = torch.cat([f[:, :1], predicted[:, :-1].detach()], 1)  # [B, T-1, H]
        return loss, stats

    def manifest_config(self) -> dict:
        return self.model.manifest_config()


class MedusaTask:
    def __init__(self, target, vocab_ids: torch.Tensor, args):
        self.model = MedusaHeads(target.config.hidden_size, args.heads)
        self.head = target.get_output_embeddings().weight.detach()[vocab_ids]  # [V', H] frozen
        self.vocab_ids, self.vocab_size = vocab_ids, target.config.vocab_size

    def losses(self, batch: dict, train: bool) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        f = batch["features"]  # [B, T, H]
        out = self.model(f)  # [K, B, T, H]
        loss, stats = 0.0, []
        for k in range(self.model.num_heads):
            shift = 2 + k
            labels = torch.full_like(batch["token_ids"], IGNORE)  # [B, T] x_{t+2+k} where it is a response token
            labels[:, :-shift] = torch.where(batch["response"][:, shift:], batch["token_ids"][:, shift:], IGNORE)
            scored = labels != IGNORE  # [B, T]
            labels = remap(labels[scored], self.vocab_ids, self.vocab_size)  # [R]
            logits = out[k][scored] @ self.head.T  # [R, V']
            loss = loss + F.cross_entropy(logits, labels, ignore_index=IGNORE)
            hit = (logits.argmax(-1) == labels) & (labels != IGNORE)
            stats.append((int(hit.sum()), len(labels)))
        return loss, stats

    def manifest_config(self) -> dict:
        return self.model.manifest_config()


class DraftLMTask:
    def __init__(self, target, vocab_ids: torch.Tensor, args):
        self.model = build_draft_lm(target.config, args.layers, target.get_input_embeddings().weight, target=target)
        self.model.train()
        self.head = target.get_output_embeddings().weight.detach()[vocab_ids]  # [V', H] frozen
        self.vocab_ids, self.vocab_size = vocab_ids, target.config.vocab_size

    def losses(self, batch: dict, train: bool) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        out = self.model.model(input_ids=batch["token_ids"], attention_mask=batch["valid"].long())
        hidden = out.last_hidden_state  # [B, T, H] after the final norm
        labels = remap(torch.where(batch["valid"], batch["target_next"], IGNORE), self.vocab_ids, self.vocab_size)
        logits = hidden @ self.head.T  # [B, T, V']
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
        judged = batch["response"] & (labels != IGNORE)
        hit = (logits.argmax(-1) == labels) & judged
        return loss, [(int(hit.sum()), int(judged.sum()))]

    def manifest_config(self) -> dict:
        return draft_lm_manifest_config(self.model)


TASKS = {"eagle": EagleTask, "medusa": MedusaTask, "draft_lm": DraftLMTask}


# -- the loop ----------------------------------------------------------------------------------------
def evaluate(task, val: list[list[Sequence]]) -> list[float]:
    task.model.eval()
    totals: list[list[int]] = []
    with torch.no_grad():
        for group in val:
            _, stats = task.losses(pad(group), train=False)
            if not totals:
                totals = [[0, 0] for _ in stats]
            for i, (hit, n) in enumerate(stats):
                totals[i][0] += hit
                totals[i][1] += n
    task.model.train()
    return [round(h / max(n, 1), 4) for h, n in totals]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m draft_service.training.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=sorted(TASKS), help="which draft to train")
    p.add_argument("--out", type=pathlib.Path, required=True, help="artifact directory to write")
    p.add_argument("--data", type=pathlib.Path, action="append", default=None,
                   help="training data dir, repeatable (default: generate_data's)")
    p.add_argument("--target-model", default=None, help="the target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--epochs", type=float, default=2.0, help="passes over the data (fractions allowed)")
    p.add_argument("--max-minutes", type=float, default=40.0, help="stop training after this long")
    p.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per step")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--head-vocab", type=int, default=16384,
                   help="the draft head scores this many most frequent tokens (0: all); verification stays exact")
    p.add_argument("--unroll", type=int, default=2, help="eagle: passes, each feeding back predicted features")
    p.add_argument("--ce-weight", type=float, default=0.1, help="eagle: token loss weight beside feature loss")
    p.add_argument("--noise", type=float, default=0.02, help="eagle: feature noise (x std) in training")
    p.add_argument("--heads", type=int, default=4, help="medusa: number of heads")
    p.add_argument("--layers", type=int, default=2, help="draft_lm: target layers to start from")
    p.add_argument("--val-fraction", type=float, default=0.03)
    p.add_argument("--reload-data", action=argparse.BooleanOptionalAction, default=True,
                   help="each epoch, add shards that appeared since the start (a generator still running)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--name", default=None, help="artifact name (default: the --out directory's name)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    started = time.perf_counter()
    loaded = load_model(args.target_model, "cpu", "float32")
    target = loaded.model
    for param in target.parameters():
        param.requires_grad_(False)
    dirs = args.data or [None]
    description = read_description(dirs[0])
    seqs = [s for d in dirs for s in load_sequences(d)]
    rng.shuffle(seqs)
    n_val = max(1, int(len(seqs) * args.val_fraction))
    val_seqs, train_seqs = seqs[:n_val], seqs[n_val:]
    counts = torch.zeros(target.config.vocab_size, dtype=torch.long)  # [V]
    for s in train_seqs:
        counts += torch.bincount(s.target_next.long(), minlength=target.config.vocab_size)
    eos = target.generation_config.eos_token_id
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    size = args.head_vocab or target.config.vocab_size
    vocab_ids = frequent_ids(counts, size, always=eos)  # [V']
    coverage = float(counts[vocab_ids].sum() / counts.sum())
    task = TASKS[args.kind](target, vocab_ids, args)
    params = [p for p in task.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)  # lr set every step (warmup + cosine)
    train_tokens = sum(len(s.token_ids) for s in train_seqs)
    steps_per_epoch = len(batches(train_seqs, args.batch_tokens, random.Random(0)))
    total_steps = max(1, int(steps_per_epoch * args.epochs))
    warmup = min(100, total_steps // 10 + 1)
    val = batches(val_seqs, args.batch_tokens, random.Random(0))
    print(f"{args.kind}: {len(train_seqs)} train / {len(val_seqs)} val sequences, {train_tokens} train tokens, "
          f"<= {total_steps} steps, head vocab {len(vocab_ids)} covers {coverage:.4f} of target tokens", flush=True)
    print(f"before training: held-out agreement {evaluate(task, val)}", flush=True)
    step, train_start = 0, time.perf_counter()
    budget_s = 60 * args.max_minutes - (train_start - started)
    seen = {p for d in dirs for p in shard_paths(d)}
    task.model.train()

    def progress() -> float:  # the cosine schedule runs on steps or on the time budget, whichever ends first
        return max(step / total_steps, (time.perf_counter() - train_start) / budget_s)

    while progress() < 1.0:
        if args.reload_data:  # shards a data generator finished meanwhile join the training set
            fresh = [p for d in dirs for p in shard_paths(d) if p not in seen]
            for path in fresh:
                seen.add(path)
                train_seqs.extend(split_shard(load_file(str(path))))
            if fresh:
                print(f"epoch start: +{len(fresh)} shards, {len(train_seqs)} train sequences", flush=True)
        for group in batches(train_seqs, args.batch_tokens, rng):
            lr = args.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(progress(), 1.0)))
            for g in optimizer.param_groups:
                g["lr"] = lr
            loss, stats = task.losses(pad(group), train=True)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            step += 1
            if step % 50 == 0:
                acc = [round(h / max(n, 1), 3) for h, n in stats]
                rate = step * args.batch_tokens / (time.perf_counter() - train_start)
                print(f"step {step} progress {progress():.2f} loss {float(loss):.4f} train agreement {acc} "
                      f"~{rate:.0f} padded tok/s", flush=True)
            if progress() >= 1.0:
                break
    agreement = evaluate(task, val)
    train_tokens = sum(len(s.token_ids) for s in train_seqs)
    elapsed = time.perf_counter() - started
    print(f"after {step} steps ({elapsed / 60:.1f} min): held-out agreement per depth/head {agreement}", flush=True)
    manifest = Manifest(
        kind=args.kind, name=args.name or args.out.name, target_identity=target_identity(loaded),
        tokenizer_fingerprint=loaded.fingerprint, config=task.manifest_config(),
        data=(f"{len(train_seqs) + len(val_seqs)} synthetic chat prompts (draft_service.training.prompts, "
              f"seed {description.get('prompts', {}).get('seed')}; {len(val_seqs)} held out) with the target's greedy responses, generated here by "
              f"draft_service.training.generate_data: {train_tokens} training tokens"),
        training={"seed": args.seed, "steps": step, "sequences": len(train_seqs),
                  "lr": args.lr, "batch_tokens": args.batch_tokens, "elapsed_s": round(elapsed, 1),
                  "threads": torch.get_num_threads(), "head_vocab": len(vocab_ids),
                  "head_vocab_coverage": round(coverage, 5), "command": " ".join([sys.executable, *sys.argv]),
                  "args": {k: str(v) for k, v in vars(args).items()}},
        measured={"heldout_agreement": agreement},
    )
    task.model.eval()
    save_artifact(args.out, task.model, manifest)
    print(json.dumps({"out": str(args.out), "heldout_agreement": agreement, "steps": step}), flush=True)


if __name__ == "__main__":
    main()
