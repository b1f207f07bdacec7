"""Does cutting a generation into more rounds cost time? Wall and CPU time against rounds, per prompt and RTT.

    python bench/network_rounds.py RUN_DIR [RUN_DIR ...] [--suffix +prov] [--prompts chat_guitar,chat_rain]

Each RUN_DIR holds a bench/network.py network.json. Every generation of a prompt commits the same tokens whatever the
configuration (each is checked against HF greedy), so where one side bounds the pipeline its time should depend on
how much work that side does, not on how the tokens were cut into verifications. For each prompt and RTT, over the
generations of every configuration whose name ends in --suffix (fixed sizes, triggers, variants alike), a
least-squares line of wall time, the draft's CPU time and the orchestrator's CPU time against the number of rounds:
ms per extra round (with its standard error), and the wall times' spread.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(slope, its standard error) of the least-squares line y = a + b x (nan when it cannot be told)."""
    n = len(xs)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if n < 3 or sxx == 0:
        return math.nan, math.nan
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys))
    return slope, math.sqrt(residual / (n - 2) / sxx)


def generations(dirs: list[pathlib.Path], suffix: str, prompts: set[str]) -> dict[tuple[str, int], list[dict]]:
    """{(prompt, rtt): [{"config", "rounds", "wall_ms", "draft_ms", "orchestrator_ms"}, ...]}."""
    out: dict[tuple[str, int], list[dict]] = {}
    for d in dirs:
        for row in json.loads((d / "network.json").read_text())["rows"]:
            if not row["config"].endswith(suffix):
                continue
            for run in row["runs"]:
                if prompts and run["prompt"] not in prompts or not run.get("identical", True):
                    continue
                cpu = run.get("cpu_ms", {})
                out.setdefault((run["prompt"], row["rtt_ms"]), []).append({
                    "config": row["config"], "rounds": run["rounds"], "wall_ms": run["seconds"] * 1e3,
                    "draft_ms": cpu.get("draft"), "orchestrator_ms": cpu.get("orchestrator")})
    return out


def report(groups: dict[tuple[str, int], list[dict]]) -> str:
    def per_round(gens: list[dict], key: str) -> str:
        pairs = [(g["rounds"], g[key]) for g in gens if g[key] is not None]
        slope, err = fit([p[0] for p in pairs], [p[1] for p in pairs]) if pairs else (math.nan, math.nan)
        return "-" if math.isnan(slope) else f"{slope:+.1f} ± {err:.1f}"

    lines = ["| prompt | RTT ms | generations (configs) | rounds | wall ms, mean ± sd | wall ms per round | "
             "draft CPU ms per round | orchestrator CPU ms per round |", "|---|--:|--:|--:|--:|--:|--:|--:|"]
    for (prompt, rtt), gens in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        walls = [g["wall_ms"] for g in gens]
        spread = statistics.stdev(walls) if len(walls) > 1 else 0.0
        rounds = [g["rounds"] for g in gens]
        lines.append(f"| {prompt} | {rtt} | {len(gens)} ({len({g['config'] for g in gens})}) | "
                     f"{min(rounds)}-{max(rounds)} | {statistics.fmean(walls):.0f} ± {spread:.0f} | "
                     f"{per_round(gens, 'wall_ms')} | {per_round(gens, 'draft_ms')} | "
                     f"{per_round(gens, 'orchestrator_ms')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("runs", nargs="+", type=pathlib.Path, help="directories with a network.json each")
    parser.add_argument("--suffix", default="+prov", help="configurations whose names end so (+prov: provisional)")
    parser.add_argument("--prompts", default="", help="comma-separated prompt ids (default: all)")
    args = parser.parse_args(argv)
    missing = [str(d) for d in args.runs if not (d / "network.json").exists()]
    if missing:
        parser.error(f"no network.json in {', '.join(missing)}")
    groups = generations(args.runs, args.suffix, set(filter(None, args.prompts.split(","))))
    if not groups:
        parser.error(f"no generation of a configuration ending in {args.suffix!r} in these runs")
    print(report(groups))
    return 0


if __name__ == "__main__":
    sys.exit(main())
