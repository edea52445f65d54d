"""Section timing (dsv4.model.sections): exclusive times of nested sections, on the CPU clock."""

from __future__ import annotations

import time

import pytest
import torch

from dsv4.model import sections


def test_nested_sections_are_timed_exclusively():
    with sections.timing(torch.device("cpu")) as marks:
        with sections.section("attention"):
            time.sleep(0.02)
            with sections.section("indexer"):
                time.sleep(0.03)
        with sections.section("attention"):
            time.sleep(0.01)
    times = sections.exclusive_ms(marks)
    assert set(times) == {"attention", "indexer"}
    assert 28 <= times["indexer"] < 45
    assert 28 <= times["attention"] < 45  # 20 + 10 ms, the nested 30 ms left out
    assert sections._marks is None  # collection stops with the block


def test_sections_outside_timing_record_nothing_and_bad_nesting_is_refused():
    with sections.section("moe"):
        pass
    with pytest.raises(ValueError, match="never closed"):
        sections.exclusive_ms([("mhc", True, 0.0)])
    with pytest.raises(ValueError, match="closed while"):
        sections.exclusive_ms([("mhc", True, 0.0), ("moe", False, 1.0)])
