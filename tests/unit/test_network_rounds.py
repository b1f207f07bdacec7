"""bench/network_rounds.py: wall and CPU time against the number of rounds."""

import json
import math
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
from network_rounds import fit, main  # noqa: E402


def test_fit_gives_the_slope_and_a_zero_error_on_a_line_and_nan_when_rounds_never_vary():
    assert fit([1, 2, 3, 4], [10, 12, 14, 16]) == pytest.approx((2.0, 0.0))
    slope, err = fit([1, 2, 3, 4], [10, 13, 13, 16])
    assert slope == pytest.approx(1.8) and err > 0
    assert all(math.isnan(v) for v in fit([3, 3, 3], [1, 2, 3]))


def test_each_run_gets_its_own_intercept_so_a_slower_run_does_not_bend_the_slope():
    # two runs of the same line y = 5 x, the second 100 ms slower throughout: per-run intercepts see slope 5 exactly
    xs, ys, runs = [1, 2, 3, 1, 2, 3], [5, 10, 15, 105, 110, 115], ["a", "a", "a", "b", "b", "b"]
    assert fit(xs, ys, runs) == pytest.approx((5.0, 0.0))
    assert fit(xs, ys)[1] > 10  # one intercept for both: the runs' gap is all noise


def _run(prompt, rounds, seconds, draft_ms):
    return {"prompt": prompt, "rounds": rounds, "seconds": seconds, "identical": True,
            "cpu_ms": {"draft": draft_ms, "orchestrator": 2.0 * rounds}}


def test_report_fits_each_prompt_and_rtt_over_the_chosen_configurations(tmp_path, capsys):
    rows = [{"rtt_ms": 0, "config": "fixed-16+prov", "runs": [_run("a", 4, 2.0, 1800)]},
            {"rtt_ms": 0, "config": "goodput+prov", "runs": [_run("a", 16, 2.0, 1800), _run("a", 10, 2.0, 1800)]},
            {"rtt_ms": 0, "config": "goodput+0", "runs": [_run("a", 8, 3.0, 1500)]}]  # left out: not +prov
    (tmp_path / "network.json").write_text(json.dumps({"rows": rows}))
    assert main([str(tmp_path)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("| a |"))
    # three +prov generations of 2000 ms whatever their rounds: no wall or draft cost per round; 2 ms of orchestrator
    assert line == "| a | 0 | 3 (2, 1) | 4-16 | 2000 ± 0 | +0.0 ± 0.0 | +0.0 ± 0.0 | +2.0 ± 0.0 |"


def test_a_directory_without_results_is_a_one_line_error(tmp_path):
    with pytest.raises(SystemExit):
        main([str(tmp_path)])
