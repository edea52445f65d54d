"""`ops.linear`: the few-row padding of `linear`; `stack_rows`: projections of one input as one GEMM, the parts as views of it."""

import pytest
import torch

from dsv4.ops.linear import MIN_GEMM_ROWS, Linear, _zero_rows, linear, stack_rows


def _fp8(rows: int, cols: int, block: int, g: torch.Generator) -> Linear:
    weight = (torch.randn(rows, cols, generator=g) * 0.5).to(torch.float8_e4m3fn)
    scale = torch.randint(118, 130, (-(-rows // block), -(-cols // block)), generator=g, dtype=torch.uint8)
    return Linear(weight, scale, block)


def test_compact_parts_stack_their_tiles_and_become_views():
    g = torch.Generator().manual_seed(3)
    a, b = _fp8(64, 96, 32, g), _fp8(32, 96, 32, g)
    whole, (a2, b2) = stack_rows([a, b])
    assert whole.scale is not None and whole.out_features == 96
    for part, view in ((a, a2), (b, b2)):  # same values, held once (in the stacked tensor)
        assert torch.equal(view.dense(torch.float32), part.dense(torch.float32))
        assert view.weight.untyped_storage().data_ptr() == whole.weight.untyped_storage().data_ptr()
    x = torch.randn(5, 96, generator=g)
    ya, yb = whole(x).split([64, 32], dim=-1)
    torch.testing.assert_close(ya, a(x), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(yb, b(x), rtol=1e-6, atol=1e-5)


def test_parts_of_partial_tiles_are_dequantised_once():
    g = torch.Generator().manual_seed(4)
    a, b = _fp8(40, 64, 32, g), _fp8(24, 64, 32, g)  # 40 rows: a partial scale tile
    whole, (a2, b2) = stack_rows([a, b])
    assert whole.scale is None and a2.scale is None and whole.weight.dtype == torch.float32
    assert torch.equal(a2.weight, a.dense(torch.float32)) and torch.equal(b2.weight, b.dense(torch.float32))


def test_dense_parts_stack_in_their_dtype():
    g = torch.Generator().manual_seed(5)
    a, b = Linear(torch.randn(8, 16, generator=g).bfloat16()), Linear(torch.randn(4, 16, generator=g).bfloat16())
    whole, (a2, b2) = stack_rows([a, b])
    assert whole.weight.dtype == torch.bfloat16 and torch.equal(whole.weight, torch.cat([a.weight, b.weight]))
    assert torch.equal(a2.weight, a.weight) and torch.equal(b2.weight, b.weight)


def test_parts_that_differ_are_refused():
    g = torch.Generator().manual_seed(6)
    with pytest.raises(ValueError, match="stack_rows: the parts must share"):
        stack_rows([_fp8(32, 64, 32, g), _fp8(64, 64, 64, g)])  # blocks 32 and 64
    with pytest.raises(ValueError, match="stack_rows: the parts must share"):
        stack_rows([_fp8(32, 64, 32, g), Linear(torch.randn(32, 64))])  # compact and dense


def test_split_rows_gives_views_of_whole_tiles_and_dequantises_partial_ones():
    g = torch.Generator().manual_seed(7)
    whole = _fp8(96, 64, 32, g)
    parts = whole.split_rows([64, 32])
    assert all(p.scale is not None for p in parts)
    assert parts[1].weight.untyped_storage().data_ptr() == whole.weight.untyped_storage().data_ptr()
    assert torch.equal(torch.cat([p.dense(torch.float32) for p in parts]), whole.dense(torch.float32))
    uneven = whole.split_rows([48, 48])  # 48 rows: half a scale tile
    assert all(p.scale is None for p in uneven)
    assert torch.equal(torch.cat([p.weight for p in uneven]), whole.dense(torch.float32))
    with pytest.raises(ValueError, match="split_rows: for projections with tile scales"):
        Linear(whole.weight, torch.zeros(96, 2, dtype=torch.uint8), 32, row_scales=True).split_rows([48, 48])


def test_few_row_calls_are_padded_to_the_gemm_rows():
    """`linear` pads calls of fewer than MIN_GEMM_ROWS rows with shared zero rows: each row
    has the bits it has in a full call, and the shared rows stay zero."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(MIN_GEMM_ROWS, 40, generator=g).bfloat16(), torch.randn(24, 40, generator=g).bfloat16()
    full = linear(x, w)
    for n in (1, 5, MIN_GEMM_ROWS - 1):
        out = linear(x[:n], w)
        assert out.shape == (n, 24) and torch.equal(out, full[:n])
    assert torch.equal(_zero_rows(x), torch.zeros(MIN_GEMM_ROWS, 40).bfloat16())
    assert _zero_rows(x) is _zero_rows(x[:3])  # one per device, dtype and width
