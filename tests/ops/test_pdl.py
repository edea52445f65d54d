"""Programmatic Dependent Launch (dsv4/ops/triton/pdl.py): the knob, and statically (from the
sources, so on any machine) the rule every fast-path kernel must keep under PDL — its first
statement is `pdl_start(PDL)` (the weight GEMM may compute prefetch addresses from program ids
before it, nothing else), and every launch passes `**launch_args(device)`. The compiled PTX
(griddepcontrol) is checked by scripts/check_kernels.py --compile-only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton) — kernel tests skipped")

from dsv4.ops.triton import pdl

KERNEL_DIR = Path(__file__).resolve().parents[2] / "dsv4/ops/triton"
# What may run before the wait in a kernel with a PREFETCH constexpr: index arithmetic on
# program ids and scalar arguments, and the L2 prefetch (no load, store, atomic or helper).
PRE_WAIT_CALLS = {"program_id", "num_programs", "arange", "cdiv", "minimum", "maximum", "prefetch_l2"}


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any("triton.jit" in ast.unparse(d) for d in fn.decorator_list)


def _is_pdl_start(stmt: ast.stmt) -> bool:
    return ast.unparse(stmt) == "pdl_start(PDL)"


def _call_name(call: ast.Call) -> str:
    return call.func.attr if isinstance(call.func, ast.Attribute) else ast.unparse(call.func)


def kernel_problems(source: str) -> tuple[list[str], list[str]]:
    """(problems, kernel names) of one module's source: every `@triton.jit` function named
    `*_kernel` and every `*_kernel[grid](...)` launch."""
    tree = ast.parse(source)
    problems, kernels = [], []
    for fn in ast.walk(tree):
        if not (isinstance(fn, ast.FunctionDef) and _is_jit(fn) and fn.name.endswith("_kernel")):
            continue
        kernels.append(fn.name)
        params = {a.arg: ast.unparse(a.annotation) if a.annotation else None for a in fn.args.args}
        if params.get("PDL") != "tl.constexpr":
            problems.append(f"{fn.name}: no `PDL: tl.constexpr` parameter")
        body = fn.body[1:] if fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body
        starts = [i for i, stmt in enumerate(body) if _is_pdl_start(stmt)]
        if not starts:
            problems.append(f"{fn.name}: `pdl_start(PDL)` is not a statement of its body")
            continue
        before = body[: starts[0]]
        if before and "PREFETCH" not in params:
            problems.append(f"{fn.name}: `pdl_start(PDL)` is not its first statement")
        for stmt in before:
            for call in (n for n in ast.walk(stmt) if isinstance(n, ast.Call)):
                if _call_name(call) not in PRE_WAIT_CALLS:
                    problems.append(f"{fn.name}: `{ast.unparse(call)}` runs before the wait")
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Subscript) and ast.unparse(call.func.value).endswith("_kernel"):
            passed = any(k.arg is None and isinstance(k.value, ast.Call) and _call_name(k.value) == "launch_args" for k in call.keywords)
            if not passed:
                problems.append(f"line {call.lineno}: the launch of {ast.unparse(call.func.value)} does not pass **launch_args(device)")
    return problems, kernels


def test_every_kernel_waits_first_and_every_launch_passes_the_launch_args():
    problems, kernels = [], []
    for path in sorted(KERNEL_DIR.glob("*.py")):
        found, names = kernel_problems(path.read_text())
        problems += [f"{path.name}: {p}" for p in found]
        kernels += names
    assert len(kernels) >= 30, kernels  # the scan found the kernels (30 when written)
    assert not problems, "\n".join(problems)


def test_the_static_check_catches_a_missed_kernel_or_launch():
    source = (KERNEL_DIR / "rowwise.py").read_text()
    assert kernel_problems(source)[0] == []
    no_wait = source.replace("    pdl_start(PDL)\n", "", 1)
    assert any("_rms_norm_kernel" in p and "pdl_start" in p for p in kernel_problems(no_wait)[0])
    late_wait = source.replace("    pdl_start(PDL)\n    row = tl.program_id(0).to(tl.int64)\n", "    row = tl.program_id(0).to(tl.int64)\n    pdl_start(PDL)\n", 1)
    assert late_wait != source and any("first statement" in p for p in kernel_problems(late_wait)[0])
    no_args = source.replace(", **launch_args(x.device))", ")", 1)
    assert no_args != source and any("_rms_norm_kernel does not pass" in p for p in kernel_problems(no_args)[0])
    gemm = (KERNEL_DIR / "fp8_gemm.py").read_text()
    assert kernel_problems(gemm)[0] == []
    load_first = gemm.replace("    pid = tl.program_id(0)\n    tiles_t", "    pid = tl.load(count_ptr)\n    tiles_t", 1)
    assert load_first != gemm and any("tl.load(count_ptr)" in p for p in kernel_problems(load_first)[0])


CUDA = torch.device("cuda")


@pytest.fixture
def sm90(monkeypatch):
    """A compiled-CUDA sm_90 setting on any machine: the capability cached, no interpreter."""
    monkeypatch.setitem(pdl._CAPABILITY, CUDA, (9, 0))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("DSV4_PDL", raising=False)
    monkeypatch.setitem(pdl.PDL, "enabled", True)
    monkeypatch.setitem(pdl.PDL, "prefetch", False)


def test_pdl_on_for_compiled_cuda_when_enabled(sm90, monkeypatch):
    assert pdl.launch_args(CUDA) == {"PDL": True, "launch_pdl": True}
    assert not pdl.prefetch(CUDA)  # off by default
    monkeypatch.setitem(pdl.PDL, "prefetch", True)
    assert pdl.prefetch(CUDA)


def test_pdl_off_on_cpu_in_the_interpreter_and_when_disabled(sm90, monkeypatch):
    monkeypatch.setitem(pdl.PDL, "prefetch", True)
    assert pdl.launch_args(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.launch_args(CUDA) == {"PDL": False} and not pdl.prefetch(CUDA)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("DSV4_PDL", "0")
    assert pdl.launch_args(CUDA) == {"PDL": False} and not pdl.prefetch(CUDA)
    monkeypatch.delenv("DSV4_PDL")
    monkeypatch.setitem(pdl.PDL, "enabled", False)  # read at call time: a device script's knob
    assert pdl.launch_args(CUDA) == {"PDL": False} and not pdl.prefetch(CUDA)
    monkeypatch.setitem(pdl.PDL, "enabled", True)
    monkeypatch.setitem(pdl._CAPABILITY, CUDA, (8, 0))  # griddepcontrol needs sm_90
    assert pdl.launch_args(CUDA) == {"PDL": False}

