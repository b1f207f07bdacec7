"""The network benchmark's report: network.md (a table per RTT, adaptive vs best fixed, provisional and
decode-burst gains, tokens/s kept against RTT 0, geometric means) and network.png (tokens/s against RTT),
written from the rows ``bench/network.py`` measured."""

from __future__ import annotations

import math
import pathlib
import sys

import procstat
from draft_trace import table as draft_table

TRIGGERS = ("edgellm", "goodput")
IDENTICAL = {True: "yes", False: "NO", None: "-"}  # None: not checked (rejection sampling)


# provisional generation in a config name: +0 off, +seed kept tokens seed the next tree (the trigger decides when
# to verify), +prov kept tokens verified at once as the next tree (pipelined, OrchestratorConfig.pipeline)
PROVISIONAL = {"0": "off", "seed": "seeds", "prov": "pipelined", "": "-"}


def parse_config(name: str) -> tuple[str, str, int | None]:
    """'goodput+prov@b1' -> ('goodput', 'prov', 1): trigger or row kind, provisional ('0', 'prov' or ''),
    decode-burst cap (None: the orchestrator's default)."""
    name, _, burst = name.partition("@b")
    base, _, prov = name.partition("+")
    return base, prov, int(burst) if burst else None


def summarize(rtt: int, name: str, runs: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    rounds = sum(r["rounds"] for r in runs)
    first_ms = sum(r["first_token_ms"] for r in runs)
    after = seconds - first_ms / 1e3  # generation time after each run's first tokens
    return {
        "rtt_ms": rtt, "config": name, "tokens": tokens, "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        "first_token_ms": first_ms / len(runs) if runs else 0.0,  # mean over the prompts
        # tokens/s after the first tokens: the decoding that triggers and provisional generation change, without the
        # prefill and first round every configuration pays alike
        "decode_tokens_per_s": (tokens - sum(r["first_tokens"] for r in runs)) / after if after > 0 else 0.0,
        "tau": tokens / rounds if rounds else 0.0,
        "verifications_per_100": 100.0 * rounds / tokens if tokens else 0.0,
        "wasted": sum(r["wasted"] for r in runs), "provisional_kept": sum(r["provisional_kept"] for r in runs),
        # (None: not checked, rejection sampling's tokens are the draft's draws)
        "identical": None if any(r["identical"] is None for r in runs) else all(r["identical"] for r in runs),
        "target_only_rounds": sum(r.get("target_only_rounds", 0) for r in runs),
        "decoded": sum(r.get("decoded", 0) for r in runs), "runs": runs,
        "busy": procstat.busy(runs),  # {"draft": share of the wall time its process was on a CPU, "verifier": ...}
    }


def busy_cell(busy: dict | None) -> str:
    """'93% / 41%': how much of the runs' time the draft's and the verifier's processes were on a CPU ('-': not read)."""
    return " / ".join(f"{busy[k]:.0%}" if k in (busy or {}) else "-" for k in ("draft", "verifier"))


def best_fixed(rows: list[dict], suffix: str) -> dict | None:
    fixed = [r for r in rows if r["config"].startswith("fixed-") and r["config"].endswith(suffix)]
    return max(fixed, key=lambda r: r["tokens_per_s"], default=None)


def report(data: dict, out: pathlib.Path) -> str:
    rows = data["rows"]
    rtts = sorted({r["rtt_ms"] for r in rows})
    lines = ["# Edge-cloud network benchmark", "", data.get("conditions", ""), ""]
    for rtt in rtts:
        at = [r for r in rows if r["rtt_ms"] == rtt]
        caches = {True: "; prompts cached on the verifier and the draft before each run (--warm-caches)",
                  False: "; every prompt computed whole (cold caches)"}.get(at[0].get("warm_caches"), "")
        lines += [f"## RTT {rtt} ms ({at[0].get('network', data.get('network', ''))}{caches})", "",
                  "| config | provisional | tokens/s | first tokens ms | tokens/s after them | tau | verifications / 100 tok "
                  "| wasted draft tokens | provisional kept | burst tokens | draft / verifier busy | identical to HF |",
                  "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|"]
        for r in at:
            base, prov, burst = parse_config(r["config"])
            label = base + (f" @b{burst}" if burst else "")
            first = f"{r['first_token_ms']:.0f} | {r['decode_tokens_per_s']:.2f}" if "first_token_ms" in r else "- | -"
            lines.append(f"| {label} | {PROVISIONAL.get(prov, prov)} | {r['tokens_per_s']:.2f} | {first} | "
                         f"{r['tau']:.2f} | {r['verifications_per_100']:.1f} | {r['wasted']} | {r['provisional_kept']} | "
                         f"{r.get('decoded', 0)} | {busy_cell(r.get('busy'))} | {IDENTICAL[r['identical']]} |")
        lines.append("")
        for suffix in ("+0", "+seed", "+prov", ""):
            fixed = best_fixed(at, suffix)
            if fixed is None:
                continue
            for trig in TRIGGERS:
                for adaptive in [r for r in at if r["config"] == trig + suffix or (not suffix and r["config"].startswith(trig + "+"))]:
                    lines.append(f"- {adaptive['config']} vs best fixed{' of any kind' if not suffix else ''} "
                                 f"({fixed['config']}): {adaptive['tokens_per_s'] / fixed['tokens_per_s']:.2f}x")
        for base in sorted({parse_config(r["config"])[0] for r in at}):
            off = next((r for r in at if r["config"] == base + "+0"), None)
            for kind in ("seed", "prov"):
                on = next((r for r in at if r["config"] == f"{base}+{kind}"), None)
                if off and on:
                    after = (f" ({on['decode_tokens_per_s'] / off['decode_tokens_per_s']:.2f}x after the first tokens)"
                             if on.get("decode_tokens_per_s") and off.get("decode_tokens_per_s") else "")
                    lines.append(f"- provisional generation ({PROVISIONAL[kind]}), {base}: "
                                 f"{on['tokens_per_s'] / off['tokens_per_s']:.2f}x tokens/s of none{after}")
        for r in at:
            single = next((x for x in at if x["config"] == r["config"] + "@b1"), None)
            if single:
                lines.append(f"- decode bursts, {r['config']} ({r.get('decoded', 0)} tokens decoded in bursts): "
                             f"{r['tokens_per_s'] / single['tokens_per_s']:.2f}x tokens/s of one token a request "
                             f"({r['config']}@b1)")
        lines += draft_table(at) + [""]
    zero = {r["config"]: r for r in rows if r["rtt_ms"] == 0}
    if zero:
        lines += ["## Tokens/s kept relative to RTT 0", "", "| config | " + " | ".join(f"RTT {t}" for t in rtts) + " |",
                  "|---|" + "--:|" * len(rtts)]
        for name in zero:
            cells = []
            for rtt in rtts:
                r = next((x for x in rows if x["rtt_ms"] == rtt and x["config"] == name), None)
                cells.append(f"{r['tokens_per_s'] / zero[name]['tokens_per_s']:.0%}" if r else "-")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    names = sorted({r["config"] for r in rows if r["config"] != "ngram"})
    complete = [n for n in names if all(any(r["config"] == n and r["rtt_ms"] == t for r in rows) for t in rtts)]
    if complete:
        def geomean(name):
            vals = [next(r for r in rows if r["config"] == name and r["rtt_ms"] == t)["tokens_per_s"] for t in rtts]
            return math.exp(sum(math.log(v) for v in vals) / len(vals))

        ranked = sorted(complete, key=geomean, reverse=True)
        lines += ["## Geometric mean tokens/s over all RTTs (the default is chosen from this)", "",
                  "| config | geomean tokens/s |", "|---|--:|"]
        lines += [f"| {n} | {geomean(n):.2f} |" for n in ranked]
        lines.append("")
    text = "\n".join(lines)
    (out / "network.md").write_text(text + "\n")
    plot(rows, out / "network.png")
    return text


def plot(rows: list[dict], path: pathlib.Path) -> None:
    try:
        import matplotlib
    except ImportError:  # the tables matter more than the picture: say how to get it, and go on
        print(f"{path.name} not drawn: matplotlib is missing (pip install -e '.[bench]')", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["config"] for r in rows):
        pts = sorted((r["rtt_ms"], r["tokens_per_s"]) for r in rows if r["config"] == name)
        style = "-" if name.endswith("+prov") else ("--" if name.endswith("+0") else ":")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=name)
    ax.set_xlabel("RTT between edge and cloud (ms)")
    ax.set_ylabel("tokens/s")
    drafter = rows[0].get("drafter", "model").split(":")[0] if rows else "model"  # model:<dir> or eagle
    ax.set_title(f"specsplit across a delayed network ({drafter} draft, greedy)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


