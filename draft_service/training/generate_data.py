"""Make training data for trained drafts: the target's own greedy responses, its features and its next tokens.

For each synthetic prompt (draft_service.training.prompts), in the seeded prompt order:

1. apply the target's chat template (user turn + generation prompt) -> prompt token ids;
2. generate the target's GREEDY response (``model.generate(do_sample=False)``), batched with left padding,
   prompts of similar length batched together; the response ends at EOS (kept) or at --max-new-tokens;
3. run ONE teacher-forced forward over prompt + response (batched, right-padded, so real positions never
   see padding) and keep, per position, the target's FINAL hidden state (``hidden_states[-1]``, after the
   final norm: what feeds the LM head) and the argmax of its logits (the target's greedy next token).

Sanity check: on the response, the target's greedy next token must be the next data token (the data IS the
target's greedy output); a few mismatches from fp near-ties between the KV-cached generate and the full
forward are tolerated and counted, more than --max-mismatch-rate aborts.

Output (--out, default $SPECSPLIT_CACHE/train-data/v1, never inside the repo): ``shard-00000.safetensors``,
... one per --shard-size prompts, written atomically as each finishes, and ``data.json`` describing them.
Rerunning with the same arguments skips finished shards, so a run can be killed and resumed any time, and
readers (draft_service.training.dataset) use whatever shards exist. Shard tensors (N sequences, L tokens):

    token_ids       [L] int32      prompt + response tokens of all sequences, concatenated
    features        [L, H] fp16    target final hidden state at each position
    target_next     [L] int32      argmax of the target's logits at each position
    offsets         [N+1] int64    sequence i is positions offsets[i]:offsets[i+1]
    response_start  [N] int32      index (within the sequence) of its first response token
    prompt_index    [N] int32      index of its prompt in generate_prompts(seed)

Example (one thread pinned to core 1, in the background):

    OMP_NUM_THREADS=1 nohup taskset -c 1 .venv/bin/python -m draft_service.training.generate_data \\
        --threads 1 > gen.log 2>&1 &
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import time

import torch
from safetensors.torch import save_file

from draft_service.training.prompts import generate_prompts
from specsplit.models import DEFAULT_GGUF_SHA256, LoadedModel, cache_dir, load_model

log = logging.getLogger("specsplit.generate_data")

FORMAT_VERSION = 1


def default_out_dir() -> pathlib.Path:
    return cache_dir() / "train-data" / "v1"


def shard_path(out: pathlib.Path, shard: int) -> pathlib.Path:
    return out / f"shard-{shard:05d}.safetensors"


def encode_prompts(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Chat-templated prompt token ids, one list per prompt."""
    ids = []
    for p in prompts:
        enc = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        if not isinstance(enc, list):  # transformers 5 returns a BatchEncoding
            enc = enc["input_ids"]
        ids.append(list(enc))
    return ids


def eos_ids(loaded: LoadedModel) -> set[int]:
    eos = loaded.model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if loaded.tokenizer.eos_token_id is not None:
        eos.append(loaded.tokenizer.eos_token_id)
    return set(eos)


@torch.inference_mode()
def generate_greedy(loaded: LoadedModel, prompt_ids: list[list[int]], max_new_tokens: int,
                    pad_id: int, eos: set[int]) -> list[list[int]]:
    """Greedy responses for a batch of prompts (left-padded); each cut after its first EOS (kept)."""
    B, P = len(prompt_ids), max(len(p) for p in prompt_ids)
    input_ids = torch.full((B, P), pad_id, dtype=torch.long)  # [B, P]
    attention_mask = torch.zeros((B, P), dtype=torch.long)  # [B, P]
    for i, p in enumerate(prompt_ids):
        input_ids[i, P - len(p):] = torch.tensor(p)
        attention_mask[i, P - len(p):] = 1
    out = loaded.model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=sorted(eos),
                                temperature=None, top_p=None, top_k=None)  # [B, P + n]
    responses = []
    for row in out[:, P:].tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
        responses.append(row[:cut])
    return responses


@torch.inference_mode()
def teacher_forced_features(loaded: LoadedModel, sequences: list[list[int]], pad_id: int
                            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(features [T, H] fp16, target_next [T] int32) per sequence from one right-padded batched forward.

    Right padding needs no attention mask: under the causal mask a real position only sees earlier real
    positions, and position ids are the natural 0..T-1, exactly as for the unpadded sequence.
    """
    B, T = len(sequences), max(len(s) for s in sequences)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)  # [B, T]
    for i, s in enumerate(sequences):
        input_ids[i, :len(s)] = torch.tensor(s)
    out = loaded.model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    hidden = out.hidden_states[-1]  # [B, T, H] after the final norm
    target_next = out.logits.argmax(-1)  # [B, T]
    return [(hidden[i, :len(s)].to(torch.float16), target_next[i, :len(s)].to(torch.int32))
            for i, s in enumerate(sequences)]


def count_mismatches(token_ids: torch.Tensor, target_next: torch.Tensor, response_start: int) -> tuple[int, int]:
    """(mismatches, checked): positions response_start-1 .. T-2 must predict the next data token."""
    pred = target_next[response_start - 1:-1]  # [R]
    data = token_ids[response_start:]  # [R]
    return int((pred != data).sum()), int(data.numel())


def build_shard(loaded: LoadedModel, prompts: list[dict], max_new_tokens: int, batch_size: int,
                pad_id: int, eos: set[int]) -> tuple[dict[str, torch.Tensor], dict]:
    """Generate, teacher-force and pack one shard's prompts; returns (tensors, stats)."""
    prompt_ids = encode_prompts(loaded.tokenizer, [p["prompt"] for p in prompts])
    order = sorted(range(len(prompts)), key=lambda i: len(prompt_ids[i]))  # similar lengths share a batch
    records = []  # (prompt_index, token_ids [T], response_start, features [T, H], target_next [T])
    stats = {"new_tokens": 0, "tokens": 0, "mismatches": 0, "checked": 0, "eos_ended": 0, "gen_s": 0.0,
             "forward_s": 0.0}
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        t0 = time.perf_counter()
        responses = generate_greedy(loaded, [prompt_ids[i] for i in idx], max_new_tokens, pad_id, eos)
        t1 = time.perf_counter()
        sequences = [prompt_ids[i] + r for i, r in zip(idx, responses)]
        forwards = teacher_forced_features(loaded, sequences, pad_id)
        t2 = time.perf_counter()
        stats["gen_s"] += t1 - t0
        stats["forward_s"] += t2 - t1
        for i, r, s, (features, target_next) in zip(idx, responses, sequences, forwards):
            token_ids = torch.tensor(s, dtype=torch.int32)  # [T]
            start = len(prompt_ids[i])
            bad, checked = count_mismatches(token_ids, target_next, start)
            stats["mismatches"] += bad
            stats["checked"] += checked
            stats["new_tokens"] += len(r)
            stats["tokens"] += len(s)
            stats["eos_ended"] += int(bool(r) and r[-1] in eos)
            records.append((prompts[i]["index"], token_ids, start, features, target_next))
        log.info("batch %d/%d: %d seqs, %d new tokens, gen %.1fs (%.1f tok/s), forward %.1fs",
                 b // batch_size + 1, -(-len(order) // batch_size), len(idx), sum(len(r) for r in responses),
                 t1 - t0, sum(len(r) for r in responses) / (t1 - t0), t2 - t1)
    records.sort(key=lambda r: r[0])  # back to prompt order
    lengths = torch.tensor([len(r[1]) for r in records], dtype=torch.int64)  # [N]
    offsets = torch.zeros(len(records) + 1, dtype=torch.int64)  # [N+1]
    offsets[1:] = lengths.cumsum(0)
    tensors = {
        "token_ids": torch.cat([r[1] for r in records]),  # [L] int32
        "features": torch.cat([r[3] for r in records]).contiguous(),  # [L, H] fp16
        "target_next": torch.cat([r[4] for r in records]),  # [L] int32
        "offsets": offsets,  # [N+1] int64
        "response_start": torch.tensor([r[2] for r in records], dtype=torch.int32),  # [N]
        "prompt_index": torch.tensor([r[0] for r in records], dtype=torch.int32),  # [N]
    }
    return tensors, stats


def write_shard(path: pathlib.Path, tensors: dict[str, torch.Tensor], stats: dict) -> None:
    """Atomic write: a reader never sees a half-written shard."""
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"format_version": str(FORMAT_VERSION),
                                           "stats": json.dumps({k: round(v, 3) for k, v in stats.items()})})
    os.replace(tmp, path)


def write_description(out: pathlib.Path, args: argparse.Namespace, loaded: LoadedModel, num_prompts_total: int,
                      shard_stats: dict[int, dict], elapsed_s: float) -> None:
    totals = {k: sum(s[k] for s in shard_stats.values()) for k in
              ("sequences", "tokens", "new_tokens", "mismatches", "checked", "eos_ended", "gen_s", "forward_s")}
    config = loaded.model.config
    description = {
        "format_version": FORMAT_VERSION,
        "format": {"token_ids": "[L] int32", "features": f"[L, {config.hidden_size}] float16",
                   "target_next": "[L] int32", "offsets": "[N+1] int64", "response_start": "[N] int32",
                   "prompt_index": "[N] int32"},
        "features": "target final hidden state (hidden_states[-1], after the final norm)",
        "target_next": "argmax of the target's logits at each position (teacher-forced)",
        "target": {"name": loaded.name, "gguf_sha256": DEFAULT_GGUF_SHA256 if args.target is None else None,
                   "path": args.target, "tokenizer_fingerprint": loaded.fingerprint, "dtype": args.dtype,
                   "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
                   "num_hidden_layers": config.num_hidden_layers},
        "prompts": {"generator": "draft_service.training.prompts.generate_prompts", "seed": args.seed,
                    "count": num_prompts_total},
        "generation": {"greedy": True, "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
                       "shard_size": args.shard_size, "chat_template": True},
        "shards": {f"shard-{k:05d}.safetensors": v for k, v in sorted(shard_stats.items())},
        "totals": {**totals, "shards": len(shard_stats)},
        "elapsed_s_this_run": round(elapsed_s, 1),
        "torch": torch.__version__,
    }
    tmp = out / "data.json.tmp"
    tmp.write_text(json.dumps(description, indent=1))
    os.replace(tmp, out / "data.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m draft_service.training.generate_data",
        description=__doc__.split("\n\n")[0] + "\n\n" + "\n\n".join(__doc__.split("\n\n")[1:4]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Resume: rerun the same command; finished shards are skipped. Kill it any time (kill PID).")
    ap.add_argument("--out", type=pathlib.Path, default=None,
                    help="output dir (default: $SPECSPLIT_CACHE/train-data/v1, else ~/.cache/specsplit/train-data/v1)")
    ap.add_argument("--target", default=None, help="local HF model dir (default: the default target SmolLM2-135M)")
    ap.add_argument("--dtype", default="float32", help="target dtype (default float32, as served)")
    ap.add_argument("--num-prompts", type=int, default=4000, help="prompts to generate (default 4000)")
    ap.add_argument("--seed", type=int, default=0, help="prompt generator seed (default 0)")
    ap.add_argument("--max-new-tokens", type=int, default=160,
                    help="response cap; EOS ends earlier (default 160; the bench generates 128)")
    ap.add_argument("--batch-size", type=int, default=16, help="prompts per generate call (default 16)")
    ap.add_argument("--shard-size", type=int, default=128,
                    help="prompts per shard; a shard is the unit of resume (default 128)")
    ap.add_argument("--max-shards", type=int, default=None, help="stop after this many shards exist")
    ap.add_argument("--first-shard", type=int, default=0,
                    help="start at this shard (prompt index first_shard * shard_size): a second process on another "
                         "core writes later prompts into another --out; train reads several --data dirs")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (set OMP_NUM_THREADS to match)")
    ap.add_argument("--max-mismatch-rate", type=float, default=0.01,
                    help="abort if more than this fraction of response positions fail the greedy check")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = args.out or default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    loaded = load_model(args.target, "cpu", args.dtype)
    tokenizer = loaded.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = eos_ids(loaded)
    prompts = generate_prompts(args.num_prompts, seed=args.seed)
    num_shards = -(-len(prompts) // args.shard_size)
    if args.max_shards is not None:
        num_shards = min(num_shards, args.max_shards)
    previous = out / "data.json"
    shard_stats: dict[int, dict] = {}
    if previous.exists():
        old = json.loads(previous.read_text())
        same = (old["prompts"]["seed"] == args.seed and old["generation"]["max_new_tokens"] == args.max_new_tokens
                and old["generation"]["shard_size"] == args.shard_size
                and old["target"]["tokenizer_fingerprint"] == loaded.fingerprint)
        if not same:
            raise SystemExit(f"{out} holds data made with other settings; pass a new --out")
        shard_stats = {int(k[6:11]): v for k, v in old["shards"].items() if shard_path(out, int(k[6:11])).exists()}
    log.info("target %s (fingerprint %s), %d prompts, %d shards of %d, %d done, out %s, threads %d",
             loaded.name, loaded.fingerprint, len(prompts), num_shards, args.shard_size, len(shard_stats), out,
             torch.get_num_threads())
    for shard in range(args.first_shard, num_shards):
        path = shard_path(out, shard)
        if path.exists() and shard in shard_stats:
            continue
        t0 = time.perf_counter()
        chunk = prompts[shard * args.shard_size:(shard + 1) * args.shard_size]
        tensors, stats = build_shard(loaded, chunk, args.max_new_tokens, args.batch_size, pad_id, eos)
        rate = stats["mismatches"] / max(stats["checked"], 1)
        if rate > args.max_mismatch_rate:
            raise SystemExit(f"shard {shard}: {stats['mismatches']}/{stats['checked']} response positions where the "
                             "target's greedy next token is not the next data token; the data is not greedy")
        write_shard(path, tensors, stats)
        stats.update(sequences=len(chunk), shard_s=round(time.perf_counter() - t0, 1))
        shard_stats[shard] = stats
        write_description(out, args, loaded, len(prompts), shard_stats, time.perf_counter() - started)
        log.info("shard %d done: %d seqs, %d tokens (%d new), %.1f new tok/s overall in shard, mismatches %d/%d, "
                 "total %d seqs", shard, len(chunk), stats["tokens"], stats["new_tokens"],
                 stats["new_tokens"] / stats["shard_s"], stats["mismatches"], stats["checked"],
                 sum(s["sequences"] for s in shard_stats.values()))


if __name__ == "__main__":
    main()
