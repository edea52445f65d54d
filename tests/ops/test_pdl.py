"""Programmatic dependent launch (`dsv4.ops.triton.pdl`): every kernel keeps the rule that
makes an early launch safe, and the launch arguments follow the device."""

import ast
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from dsv4.ops.triton import pdl  # noqa: E402

TRITON_DIR = Path(pdl.__file__).parent


def _kernels():
    for path in sorted(TRITON_DIR.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                yield f"{path.name}:{node.name}", node


def _violation(name: str, fn: ast.FunctionDef) -> str | None:
    """Why a kernel breaks the PDL rule (a PDL constexpr, and `begin(PDL)` as the first
    statement after the docstring), or None."""
    if "PDL" not in [a.arg for a in fn.args.args]:
        return f"{name} takes no PDL constexpr"
    body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body
    first = body[0] if body else None
    call = first.value if isinstance(first, ast.Expr) and isinstance(first.value, ast.Call) else None
    if not (call and isinstance(call.func, ast.Name) and call.func.id == "begin"
            and [a.id for a in call.args if isinstance(a, ast.Name)] == ["PDL"] and len(call.args) == 1):
        return f"{name}: the first statement is not begin(PDL)"
    return None


def test_every_kernel_begins_with_the_wait():
    """Before `begin(PDL)` an early-launched kernel could read its predecessor's half-written
    output or overwrite what the predecessor still reads."""
    kernels = list(_kernels())
    assert len(kernels) > 30
    assert [v for name, fn in kernels if (v := _violation(name, fn))] == []


@pytest.mark.parametrize("src, found", [
    ('def _k(x_ptr, PDL: tl.constexpr):\n    """doc"""\n    v = tl.load(x_ptr)\n    begin(PDL)\n', "not begin(PDL)"),
    ("def _k(x_ptr, PDL: tl.constexpr):\n    v = tl.load(x_ptr)\n", "not begin(PDL)"),
    ("def _k(x_ptr, PDL: tl.constexpr):\n    begin(False)\n", "not begin(PDL)"),
    ("def _k(x_ptr):\n    begin(PDL)\n", "no PDL constexpr"),
])
def test_the_rule_check_finds_what_breaks_it(src, found):
    assert found in _violation("k", ast.parse(src).body[0])
    good = 'def _k(x_ptr, PDL: tl.constexpr):\n    """doc"""\n    begin(PDL)\n    v = tl.load(x_ptr)\n'
    assert _violation("k", ast.parse(good).body[0]) is None


def test_launch_arguments(monkeypatch):
    cuda = torch.device("cuda", 0)
    assert pdl.pdl_launch(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setitem(pdl._CAPABLE, cuda, True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert pdl.pdl_launch(cuda) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setattr(pdl, "PDL", False)
    assert pdl.pdl_launch(cuda) == {"PDL": False}
    monkeypatch.setattr(pdl, "PDL", True)
    monkeypatch.setitem(pdl._CAPABLE, cuda, False)  # before sm_90
    assert pdl.pdl_launch(cuda) == {"PDL": False}
    monkeypatch.setitem(pdl._CAPABLE, cuda, True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.pdl_launch(cuda) == {"PDL": False}
    assert not pdl.compiled(cuda) and not pdl.compiled(torch.device("cpu"))
    monkeypatch.delenv("TRITON_INTERPRET")
    assert pdl.compiled(cuda)
