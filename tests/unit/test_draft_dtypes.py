"""From how many tokens the half draft's forwards go to its many-token dtype: where the calibration's two timed forwards
of each chosen dtype (one token, MANY_TOKENS) put that dtype's line below the step dtype's (draft_service.dtypes)."""

import torch

from draft_service.dtypes import MANY_FROM_MAX, MANY_TOKENS, Calibration
from draft_service.quantized import INT4


def calibration(step_line, many_line) -> Calibration:
    return Calibration(INT4, torch.bfloat16, {}, {}, lines={INT4: step_line, torch.bfloat16: many_line})


def test_the_many_token_dtype_takes_forwards_from_where_its_line_crosses_the_step_dtypes():
    # a Xeon's int4 and bfloat16 (one token, 16 tokens): 23.5 + 4.17 (n - 1) against 63.5 + 3.14 (n - 1)
    assert calibration((23.5, 86.1), (63.5, 110.6)).many_from() == 40
    # a step dtype whose many-token forwards are slow (float16 on a CPU without 16-bit matrix units)
    assert calibration((18.5, 300.0), (37.8, 60.0)).many_from() == 3
    assert calibration((50.0, 60.0), (10.0, 20.0)).many_from() == 2  # faster at any size: from 2 tokens on


def test_lines_that_do_not_cross_within_the_timed_range_stop_at_a_cap():
    assert calibration((10.0, 20.0), (50.0, 90.0)).many_from() == MANY_FROM_MAX  # prompts still go to it


def test_nothing_timed_leaves_the_proposers_default():
    assert Calibration(INT4, INT4, {}, {}, lines={INT4: (20.0, 80.0)}).many_from() is None  # one dtype for both
    assert Calibration(INT4, torch.bfloat16, {}, {}).many_from() is None  # recalled or given, not timed
    assert MANY_TOKENS < MANY_FROM_MAX
