"""bench/network_repeats.py: pooling repeated network-benchmark runs."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
from network_repeats import pool, repeat_lines  # noqa: E402


def _run(prompt: str, tokens: int, seconds: float) -> dict:
    return {"prompt": prompt, "tokens": tokens, "seconds": seconds, "rounds": 4, "first_token_ms": 100.0,
            "first_tokens": 2, "wasted": 1, "provisional_kept": 0, "identical": True}


def _row(rtt: int, config: str, seconds: list[float]) -> dict:
    runs = [_run(p, 100, s) for p, s in zip(("a", "b"), seconds)]
    return {"rtt_ms": rtt, "config": config, "runs": runs, "tokens_per_s": 200 / sum(seconds)}


def test_pooled_rate_is_all_tokens_over_all_seconds_and_each_repeat_is_compared_with_the_pooled_best_fixed():
    one = {"rows": [_row(0, "fixed-8+prov", [1.0, 1.0]), _row(0, "fixed-16+prov", [2.0, 2.0]),
                    _row(0, "goodput+prov", [1.25, 1.25])]}
    two = {"rows": [_row(0, "fixed-8+prov", [1.5, 1.5]), _row(0, "fixed-16+prov", [1.0, 1.0]),
                    _row(0, "goodput+prov", [1.0, 1.0])]}
    rows = {r["config"]: r for r in pool([one, two])["rows"]}
    assert rows["fixed-8+prov"]["tokens_per_s"] == pytest.approx(400 / 5.0)
    assert rows["fixed-16+prov"]["tokens_per_s"] == pytest.approx(400 / 6.0)
    assert rows["goodput+prov"]["repeats"] == pytest.approx([80.0, 100.0])
    line = next(x for x in repeat_lines(list(rows.values())) if "goodput+prov /" in x)
    # best fixed pooled: fixed-8 (80 tok/s); goodput 400 tokens in 4.5 s pooled: 1.11x; run 1 80/100, run 2 100/66.7
    assert "(fixed-8+prov): pooled 1.11x; each run 0.80x, 1.50x (ahead in 1 of 2)" in line


def test_runs_of_different_prompts_are_refused():
    one = {"rows": [_row(0, "fixed-8+prov", [1.0, 1.0])]}
    other = {"rows": [dict(_row(0, "fixed-8+prov", [1.0]), runs=[_run("c", 100, 1.0)])]}
    with pytest.raises(ValueError, match="different prompts"):
        pool([one, other])


def test_pooling_one_kind_of_prompt_recomputes_each_repeat_over_those_prompts():
    one = {"rows": [_row(0, "fixed-8+prov", [1.0, 3.0]), _row(0, "goodput+prov", [2.0, 1.0])]}
    two = {"rows": [_row(0, "fixed-8+prov", [1.0, 1.0]), _row(0, "goodput+prov", [0.5, 4.0])]}
    rows = {r["config"]: r for r in pool([one, two], prompts={"a"})["rows"]}
    assert rows["fixed-8+prov"]["repeats"] == pytest.approx([100.0, 100.0])  # prompt "a" only: 100 tokens in 1 s
    assert rows["goodput+prov"]["repeats"] == pytest.approx([50.0, 200.0])
    assert rows["goodput+prov"]["tokens_per_s"] == pytest.approx(200 / 2.5)
    assert [r["prompt"] for r in rows["goodput+prov"]["runs"]] == ["a", "a"]
