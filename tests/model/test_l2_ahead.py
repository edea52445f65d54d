"""Weights asked of L2 ahead of their kernels (`model.L2Ahead`): which weights each site
names, and that it is off where it cannot run (the ranges a budget gives:
tests/ops/test_l2_prefetch.py). The prefetch changes no value, only timing (docs/PERF.md)."""

from __future__ import annotations

from dsv4.model import model as model_module
from test_fast_path import FOLDER, GREEDY, golden_data, golden_llm


def _same(tensors, expected) -> bool:
    """The same storage and shape, one for one (the stacked weights' slices are new views)."""
    key = lambda t: (t.data_ptr(), t.shape)
    return [key(t) for t in tensors] == [key(t) for t in expected]


class _Recorder:
    """An `L2Ahead` that records each site's request (the knob's gates included) instead of
    launching it."""

    def __init__(self, device):
        self.aside = model_module.Aside(device, False)
        self.calls = []

    def ahead(self, site, rows, tensors):
        self.calls.append((site, rows, tensors))


def test_each_site_names_the_weights_its_next_streaming_kernel_reads(monkeypatch):
    """wo_a and wo_b once the queries are projected; the shared expert's gate_up after the
    attention; the next layer's wq_a + wkv and wq_b after the MoE (none after the last layer),
    on every row count the pieces run (the encoder's prompt rows, the decoder's kept rows)."""
    golden_data(FOLDER)  # skips without the golden set
    monkeypatch.setitem(model_module.L2_AHEAD, "enabled", True)
    llm = golden_llm(FOLDER, True)
    model = llm.engine.model
    assert model.l2.aside.stream is None  # knob on, but CPU: nothing is launched
    model.l2 = recorder = _Recorder(model.device)
    llm.generate([[5, 6, 7, 8, 9, 10]], GREEDY, use_tqdm=False)
    blocks = model.blocks
    per_step = []
    for site, rows, tensors in recorder.calls:
        if site == "out" and (not per_step or len(per_step[-1]) == 3 * len(blocks) - 1):
            per_step.append([])
        per_step[-1].append((site, rows, tensors))
    assert len(per_step) == GREEDY.max_tokens  # one prefill, then decode steps
    for calls in per_step:
        assert len(calls) == 3 * len(blocks) - 1
        for i, block in enumerate(blocks):
            out, shared, *after = calls[3 * i : 3 * i + 3]
            assert out[0] == "out" and _same(out[2], [block.attn.wo_a.weight, block.attn.wo_b.weight])
            assert shared[0] == "shared" and _same(shared[2], [block.ffn.shared_gate_up()])
            if i + 1 < len(blocks):
                nxt = blocks[i + 1].attn
                assert after[0][0] == "next" and _same(after[0][2], [nxt.wq_a_kv.weight, (nxt.wq_b_idx or nxt.wq_b).weight])
            assert out[1] == shared[1] == (after[0][1] if after else out[1])
    assert per_step[1][-1][1] == 1  # decode: one row

