"""The L2 prefetch's byte ranges (`ops.triton.l2`): how a budget cuts a list of weights, and
the inputs bulk prefetch cannot take. The prefetch itself changes no value; the model's use of
it: tests/model/test_l2_ahead.py."""

from __future__ import annotations

import pytest
import torch

from dsv4.ops.triton import l2


def test_ranges_take_the_budget_in_order():
    a, b = torch.zeros(1000, dtype=torch.uint8), torch.zeros(64, 64, dtype=torch.bfloat16)
    assert [(t is a, n) for t, n in l2.prefetch_ranges([a, b], 10 << 20)] == [(True, 992), (False, 8192)]  # 1000 cut to 16s
    assert [(t is a, n) for t, n in l2.prefetch_ranges([a, b], 2000)] == [(True, 992), (False, 1008)]
    assert [(t is a, n) for t, n in l2.prefetch_ranges([a, b], 500)] == [(True, 496)]  # the budget ends inside a
    assert l2.prefetch_ranges([a, b], 15) == []


def test_ranges_refuse_what_bulk_prefetch_cannot_take():
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not contiguous"):
        l2.prefetch_ranges([w.t()], 1 << 20)
    with pytest.raises(ValueError, match="16-byte aligned"):
        l2.prefetch_ranges([w.view(-1)[1:]], 1 << 20)
    with pytest.raises(ValueError, match="at most two ranges"):
        l2.prefetch_ranges([w, w, w], 1 << 20)
    with pytest.raises(ValueError, match="compiled kernels on a CUDA device"):
        l2.prefetch_l2([w], 1 << 20)
