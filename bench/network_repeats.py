"""Pool repeated runs of ``bench/network.py`` into one report, with each repeat's ratios beside the pooled ones.

One run of the network benchmark leaves single-run noise of about ±10% in every cell, the size of the differences
between the pipelined configurations. Run the same command several times (into different --out directories, the
configurations' order changed between runs so that none always goes first), then::

    python bench/network_repeats.py /tmp/rep/run1 /tmp/rep/run2 /tmp/rep/run3 --out bench/results/network_repeats

(``--prompts a,b``: only those prompts, e.g. one kind of them) writes <out>/network.json (each RTT and
configuration's prompts of every repeat pooled: tokens/s is all their tokens over all their seconds), <out>/network.md
and network.png (``network_report.report`` of the pooled rows) and, at the end of network.md, a "Repeats" section:
each configuration's tokens/s in each repeat, and for each adaptive trigger its ratio to the best fixed size (the best
by pooled tokens/s) pooled and in each repeat, and how many repeats it was ahead.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from network_report import TRIGGERS, parse_config, report, summarize


def pool(datas: list[dict], prompts: set[str] | None = None) -> dict:
    """Rows of several runs -> one row per (RTT, config) over all their prompts (or only ``prompts``); ``repeats``:
    each run's tokens/s over them (None where that run lacks the row)."""
    keys = list(dict.fromkeys((r["rtt_ms"], r["config"]) for d in datas for r in d["rows"]))
    rows = []
    for rtt, name in keys:
        found = [next((r for r in d["rows"] if (r["rtt_ms"], r["config"]) == (rtt, name)), None) for d in datas]
        if prompts is not None:
            found = [only(r, prompts) if r else None for r in found]
        measured = {tuple(sorted(run["prompt"] for run in r["runs"])) for r in found if r}
        if len(measured) > 1:
            raise ValueError(f"RTT {rtt} {name}: the runs measured different prompts ({sorted(measured)}); "
                             "pool runs of the same command")
        row = summarize(rtt, name, [run for r in found if r for run in r["runs"]])
        for key in ("network", "warm_caches", "drafter", "draft_dtype", "temperature"):
            row[key] = next((r[key] for r in found if r and key in r), None)
        row["repeats"] = [r["tokens_per_s"] if r else None for r in found]
        rows.append(row)
    conditions = "; ".join(dict.fromkeys(d.get("conditions", "") for d in datas if d.get("conditions")))
    return {"rows": rows, "conditions": f"{len(datas)} runs pooled. {conditions}".strip()}


def only(row: dict, prompts: set[str]) -> dict | None:
    """``row`` summarized again over its runs of ``prompts`` only (None: it has none)."""
    runs = [run for run in row["runs"] if run["prompt"] in prompts]
    return {**row, **summarize(row["rtt_ms"], row["config"], runs)} if runs else None


def repeat_lines(rows: list[dict]) -> list[str]:
    """The "Repeats" section: per-run tokens/s, and each adaptive trigger against the pooled best fixed size."""
    n = max((len(r["repeats"]) for r in rows), default=0)
    lines = ["## Repeats", "", "| RTT | config | pooled tokens/s | " + " | ".join(f"run {i + 1}" for i in range(n)) + " |",
             "|--:|---|--:|" + "--:|" * n]
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['rtt_ms']} | {r['config']} | {r['tokens_per_s']:.2f} | "
                     + " | ".join(fmt(v) for v in r["repeats"]) + " |")
    lines.append("")
    for rtt in sorted({r["rtt_ms"] for r in rows}):
        at = [r for r in rows if r["rtt_ms"] == rtt]
        for suffix in ("+0", "+prov"):
            fixed = [r for r in at if r["config"].startswith("fixed-") and parse_config(r["config"])[1] == suffix[1:]]
            if not fixed:
                continue
            best = max(fixed, key=lambda r: r["tokens_per_s"])
            for trig in TRIGGERS:
                adaptive = next((r for r in at if r["config"] == trig + suffix), None)
                if adaptive is None:
                    continue
                each = [a / b for a, b in zip(adaptive["repeats"], best["repeats"]) if a and b]
                ahead = sum(x > 1 for x in each)
                lines.append(f"- RTT {rtt}: {adaptive['config']} / best fixed ({best['config']}): pooled "
                             f"{adaptive['tokens_per_s'] / best['tokens_per_s']:.2f}x; each run "
                             + ", ".join(f"{x:.2f}x" for x in each) + f" (ahead in {ahead} of {len(each)})")
    return lines + [""]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="results directories of bench/network.py runs (each has network.json)")
    parser.add_argument("--out", required=True, help="where the pooled network.json, .md and .png go")
    parser.add_argument("--prompts", help="comma-separated prompt ids: pool only these (default: every prompt)")
    args = parser.parse_args(argv)
    datas = []
    for d in args.runs:
        path = pathlib.Path(d) / "network.json"
        if not path.exists():
            parser.error(f"{path} does not exist: each run is a directory bench/network.py --out wrote")
        datas.append(json.loads(path.read_text()))
    try:
        pooled = pool(datas, set(args.prompts.split(",")) if args.prompts else None)
    except ValueError as err:
        parser.error(str(err))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "network.json").write_text(json.dumps(pooled, indent=1))
    text = report(pooled, out) + "\n\n" + "\n".join(repeat_lines(pooled["rows"]))
    (out / "network.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
