"""Does cutting a generation into more rounds cost time? Wall and CPU time against rounds, per prompt and RTT.

    python bench/network_rounds.py RUN_DIR [RUN_DIR ...] [--suffix +prov] [--prompts chat_guitar,chat_rain]

Each RUN_DIR holds a bench/network.py network.json. Every generation of a prompt commits the same tokens whatever the
configuration (each is checked against HF greedy), so where one side bounds the pipeline its time should depend on
how much work that side does, not on how the tokens were cut into verifications. For each prompt and RTT, over the
generations of every configuration whose name ends in --suffix (fixed sizes, triggers, variants alike), a
least-squares line of wall time, the draft's CPU time and the orchestrator's CPU time against the number of rounds,
with an intercept of its own for each run (a shared machine's speed drifts between runs; within a run the
configurations take turns): ms per extra round (with its standard error), and the wall times' spread. CPU times are
read in clock ticks (10 ms on most Linux machines), coarse next to a few ms per round: the slope over many generations
is what tells. Sampled runs' generations are included (their tokens are checked too, or are rejection sampling's).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys


def fit(xs: list[float], ys: list[float], groups: list | None = None) -> tuple[float, float]:
    """(slope, its standard error) of the least-squares lines y = a_g + b x, one intercept a_g per group (default:
    one group), a common slope b (nan when it cannot be told)."""
    groups = groups if groups is not None else [0] * len(xs)
    members: dict = {}
    for x, y, g in zip(xs, ys, groups):
        members.setdefault(g, []).append((x, y))
    dx, dy = [], []  # each point less its group's means: what is left for the slope
    for points in members.values():
        mx, my = statistics.fmean(p[0] for p in points), statistics.fmean(p[1] for p in points)
        dx += [p[0] - mx for p in points]
        dy += [p[1] - my for p in points]
    free = len(xs) - len(members) - 1  # degrees of freedom left after the intercepts and the slope
    sxx = sum(x * x for x in dx)
    if free < 1 or sxx == 0:
        return math.nan, math.nan
    slope = sum(x * y for x, y in zip(dx, dy)) / sxx
    residual = sum((y - slope * x) ** 2 for x, y in zip(dx, dy))
    return slope, math.sqrt(residual / free / sxx)


def generations(dirs: list[pathlib.Path], suffix: str, prompts: set[str]) -> dict[tuple[str, int], list[dict]]:
    """{(prompt, rtt): [{"run", "config", "rounds", "wall_ms", "draft_ms", "orchestrator_ms"}, ...]}."""
    out: dict[tuple[str, int], list[dict]] = {}
    for d in dirs:
        for row in json.loads((d / "network.json").read_text())["rows"]:
            if not row["config"].endswith(suffix):
                continue
            for run in row["runs"]:
                if prompts and run["prompt"] not in prompts or run.get("identical") is False:
                    continue  # (a generation that differed from the reference is a bug to look at, not a timing)
                cpu = run.get("cpu_ms", {})
                out.setdefault((run["prompt"], row["rtt_ms"]), []).append({
                    "run": str(d), "config": row["config"], "rounds": run["rounds"], "wall_ms": run["seconds"] * 1e3,
                    "draft_ms": cpu.get("draft"), "orchestrator_ms": cpu.get("orchestrator")})
    return out


def report(groups: dict[tuple[str, int], list[dict]]) -> str:
    def per_round(gens: list[dict], key: str) -> str:
        kept = [g for g in gens if g[key] is not None]
        slope, err = fit([g["rounds"] for g in kept], [g[key] for g in kept], [g["run"] for g in kept])
        return "-" if math.isnan(slope) else f"{slope:+.1f} ± {err:.1f}"

    lines = ["| prompt | RTT ms | generations (configs, runs) | rounds | wall ms, mean ± sd | wall ms per round | "
             "draft CPU ms per round | orchestrator CPU ms per round |", "|---|--:|--:|--:|--:|--:|--:|--:|"]
    for (prompt, rtt), gens in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        walls = [g["wall_ms"] for g in gens]
        spread = statistics.stdev(walls) if len(walls) > 1 else 0.0
        rounds = [g["rounds"] for g in gens]
        configs, runs = len({g["config"] for g in gens}), len({g["run"] for g in gens})
        lines.append(f"| {prompt} | {rtt} | {len(gens)} ({configs}, {runs}) | "
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
