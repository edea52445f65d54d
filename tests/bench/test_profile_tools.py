"""The device profiling tools' CPU-runnable parts: `profile_step.torch_op_table` (an eager
step's aten ops by source line), `time_step_build.py` (the host's share of a graph step),
`ncu_kernels.source_summary` (Nsight Compute's source page by opcode) and device_run.sh's
functions (`bench`: which tree an A/B variant imports; `knobbed`, `exit_said`, the Triton
cache's round trip between calls)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import profile_step  # noqa: E402

from dsv4.bench import forward as bench  # noqa: E402
from dsv4.bench.roofline import parse_cases, plan_case  # noqa: E402
from dsv4.model.model import Model  # noqa: E402
from dsv4.model.random_weights import random_weights  # noqa: E402


def test_torch_op_table_attributes_ops_to_model_lines():
    cfg = bench.bench_config("tiny-v41")
    model = Model(cfg, random_weights(cfg, dtype=torch.bfloat16, device="cpu", compact=False, seed=0), dtype=torch.bfloat16,
                  device="cpu", token_map=torch.zeros(cfg.vocab_size, dtype=torch.long), fast_path=True)
    case = parse_cases(["d=2*1@300"])[0]
    cache, batch = bench.build_case(cfg, plan_case(cfg, case), block_size=256, dtype=torch.bfloat16, device=torch.device("cpu"), seed=0)
    table = profile_step.torch_op_table(model, batch, cache)
    assert table and all(row["calls"] > 0 for row in table)
    assert [row["calls"] for row in table] == sorted((row["calls"] for row in table), reverse=True)
    # every op is placed at a dsv4 source line; views and metadata ops are not counted
    assert all(row["where"].endswith(tuple("0123456789")) and ".py:" in row["where"] for row in table)
    assert not {row["op"] for row in table} & profile_step._NO_KERNEL
    # the CPU fast path runs its ops' torch code: the compressor's reference is among them
    assert any(row["where"].startswith("ops/compressor.py:") for row in table)


def test_time_step_build_prints_both_timings():
    out = subprocess.run([sys.executable, str(REPO / "scripts/time_step_build.py"), "a=2*1@300", "--num-layers", "4", "--calls", "3", "--repeats", "1"],
                         capture_output=True, text=True, cwd=REPO, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "a=2*1@300: build_step " in out.stdout and "build_step + load " in out.stdout


_SOURCE_COLUMNS = '"Address","Source","Warp Stall Sampling (All Samples)","L1 Wavefronts Shared Excessive","L1 Wavefronts Shared"'


def _source_page(kernel: str, rows: list[tuple[str, str, str, str]]) -> str:
    lines = [f'"Kernel Name","{kernel}",', _SOURCE_COLUMNS]
    lines += [",".join(f'"{cell}"' for cell in (address, sass, stalls, excess, "0")) for address, sass, stalls, excess in rows]
    return "\n".join(lines) + "\n"


def test_ncu_source_summary_groups_by_opcode():
    """`ncu_kernels.source_summary` reads ncu's source-page CSV (one block per kernel, counts
    with thousands separators, empty cells for none): shares by opcode without predicates or
    modifiers, the top instructions by count."""
    import ncu_kernels

    text = _source_page("_pv_kernel", [
        ("0x10", "@P1   LDGSTS.E.BYPASS.128 desc[UR4][R2.64], P1, [R3]", "100", "3,000"),
        ("0x20", "LDSM.16.M88.4 R8, [R9]", "300", ""),
        ("0x30", "LDGSTS.E.BYPASS.128 desc[UR4][R2.64+0x10], P1, [R3+0x10]", "", "1,000"),
        ("0x40", "MUFU.EX2 R1, R2", "100", "0"),
    ]) + _source_page("_logits_kernel", [("0x50", "STS.128 [R1], R4", "10", "5")])
    summary = ncu_kernels.source_summary(text, top=2)
    assert list(summary) == ["_pv_kernel", "_logits_kernel"]
    pv = summary["_pv_kernel"]
    assert pv["stalls"]["total"] == 500 and pv["stalls"]["by_opcode"] == {"LDSM": 0.6, "LDGSTS": 0.2, "MUFU": 0.2}
    assert pv["excess_shared"]["by_opcode"] == {"LDGSTS": 1.0}
    assert [address for address, _, _ in pv["excess_shared"]["top"]] == ["0x10", "0x30"]
    assert [address for address, _, _ in pv["stalls"]["top"]] == ["0x20", "0x10"]
    assert summary["_logits_kernel"]["excess_shared"]["top"] == [("0x50", "STS.128 [R1], R4", 5.0)]


def test_ncu_source_summary_counts_instructions_and_stall_reasons():
    """Where the page has them, the executed warp instructions by opcode and the stall samples
    by reason (all samples; the "(Not Issued)" columns left out)."""
    import ncu_kernels

    columns = (_SOURCE_COLUMNS + ',"Instructions Executed","stall_long_sb","stall_barrier","stall_long_sb (Not Issued)"')
    text = "\n".join(['"Kernel Name","_pv_kernel",', columns,
                      '"0x10","IMAD.SHL.U32 R1, R2, 0x100, RZ","30","0","0","3,000","24","6","99"',
                      '"0x20","IMAD R3, R4, R5, RZ","10","0","0","1,000","","10","99"',
                      '"0x30","LDSM.16.M88.4 R8, [R9]","0","0","0","4,000","0","0","0"']) + "\n"
    pv = ncu_kernels.source_summary(text)["_pv_kernel"]
    assert pv["instructions"] == {"total": 8000, "by_opcode": {"IMAD": 0.5, "LDSM": 0.5}}
    assert pv["stall_reasons"] == {"long_sb": 0.6, "barrier": 0.4}


def test_ncu_source_summary_names_missing_counters():
    """A source page profiled without SourceCounters has no stall or wavefront columns: the
    error says which and how to get them."""
    import ncu_kernels

    text = '"Kernel Name","_pv_kernel",\n"Address","Source","# Samples"\n"0x10","MUFU.EX2 R1, R2","4"\n'
    with pytest.raises(ValueError, match=r"_pv_kernel.*L1 Wavefronts Shared Excessive.*SourceCounters"):
        ncu_kernels.source_summary(text)


def test_timeline_summary_counts_from_the_first_kernel():
    """A metadata copy, 500 us of host time, then kernels: two in a row (a 1 us gap), one beside
    them on another stream (overlapping by 3 us), one after a 2 us gap."""
    def entry(name, start, us, gap):
        return {"name": name, "stream": 7, "start_us": start, "us": us, "gap_us": gap}

    timeline = [entry("Memcpy HtoD (Pinned -> Device)", 0.0, 1.0, 0.0), entry("_a", 501.0, 10.0, 500.0),
                entry("_b", 512.0, 5.0, 1.0), entry("_side", 514.0, 4.0, -3.0), entry("_c", 520.0, 2.0, 2.0)]
    got = profile_step.timeline_summary(timeline)
    # span 501 -> 522; busy 21; gaps 1 + 2 (the overlap's negative gap is no idle time); 21 - (21 - 3) ran beside
    assert got == {"kernels": 4, "span_us": 21.0, "busy_us": 21.0, "gaps_us": 3.0, "beside_us": 3.0, "lead_us": 501.0}
    with pytest.raises(ValueError, match="no kernel"):
        profile_step.timeline_summary(timeline[:1])


def test_per_call_keeps_each_kernels_calls_in_start_order():
    def entry(name, us):
        return {"name": name, "stream": 7, "start_us": 0.0, "us": us, "gap_us": 0.0}

    timeline = [entry("_logits", 15.0), entry("_pv", 5.5), entry("_logits", 13.7), entry("_pv", 12.0), entry("_logits", 14.1)]
    assert profile_step.per_call(timeline) == {"_logits": [15.0, 13.7, 14.1], "_pv": [5.5, 12.0]}


def _fake_tree(root: Path, name: str) -> None:
    """A package `dsv4` under root whose `cli.main` prints `name` and its arguments."""
    (root / "dsv4").mkdir(parents=True)
    (root / "dsv4" / "__init__.py").write_text("")
    (root / "dsv4" / "cli.py").write_text(f"def main(argv):\n    print({name!r}, argv)\n    return 0\n")


def _device_run_functions(*names: str) -> str:
    """The text of device_run.sh's shell functions `names`."""
    script = (REPO / "scripts" / "device_run.sh").read_text()
    starts = [script.index(f"{name}() {{") for name in names]
    return "".join(script[start : script.index("\n}\n", start) + 3] for start in starts)


def test_device_run_runs_scripts_under_the_knobs(tmp_path):
    """`knobbed` runs a script (the profile step's profile_step.py) as __main__ with its
    arguments, after setting the KNOBS in the modules it imports: a module global and an entry
    of a nested table."""
    _fake_tree(tmp_path, "new")
    (tmp_path / "dsv4" / "knobs.py").write_text("FLAG = False\nTABLE = {'rows': ({'n': 1},)}\n")
    (tmp_path / "show.py").write_text("import sys\nfrom dsv4 import knobs\nprint(__name__, sys.argv[1:], knobs.FLAG, knobs.TABLE['rows'][0]['n'])\n")
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(tmp_path),
           "KNOBS": "dsv4.knobs:FLAG=True dsv4.knobs:TABLE.rows.0.n=7"}
    out = subprocess.run(["bash", "-c", _device_run_functions("knobbed") + "\nknobbed 60 show.py --x 1"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.splitlines()[-1] == "__main__ ['--x', '1'] True 7", out


@pytest.mark.parametrize("tree", ["old", "new"])
def test_device_run_bench_imports_the_tree_pythonpath_names(tmp_path, tree):
    """device_run.sh's `bench` runs from the checkout's root, where its own dsv4/ sits; an A/B
    variant's PYTHONPATH (AB_ENV='PYTHONPATH=$PWD/ab_old') must still decide which tree the
    bench imports (a stdin script's directory would otherwise come first on sys.path)."""
    function = _device_run_functions("knobbed", "bench")
    checkout = tmp_path / "checkout"
    _fake_tree(checkout, "new")
    _fake_tree(checkout / "ab_old", "old")
    path = checkout / "ab_old" if tree == "old" else checkout
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(path), "KNOBS": ""}
    out = subprocess.run(["bash", "-c", function + "\nbench 60 --cases x"], cwd=checkout, env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split() == [tree, "['bench',", "'forward',", "'--cases',", "'x']"], out


@pytest.mark.parametrize("script", ["profile_step", "time_step_build", "ncu_kernels", "check_kernels"])
def test_device_scripts_import_no_kernel_module(script):
    """Test modules import these scripts at collection time, before tests/ops/conftest.py sets
    TRITON_INTERPRET=1: a kernel module imported then stays compiled-only, and every CPU kernel
    test after it fails (as a module-level `pdl` import in profile_step once made 214 fail)."""
    code = f"import sys; sys.path.insert(0, 'scripts'); import {script}; print([m for m in sys.modules if m.startswith('dsv4.ops.triton')])"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_device_run_kernels_ab_runs_each_trees_defaults_section(tmp_path):
    """device_run.sh's `kernels_ab`: check_kernels' `defaults` section once per AB_ENV variant,
    from the variant's AB_TREE, each writing under its own $OUT/kernels_ab<i>."""
    checkout = tmp_path / "checkout"
    for tree, root in (("new", checkout), ("old", checkout / "ab_old")):
        (root / "scripts").mkdir(parents=True)
        (root / "scripts" / "check_kernels.py").write_text(
            f"import os, sys\nprint('attention_sweep {tree}', sys.argv[1:], os.path.basename(os.environ['OUT']))\n")
    (checkout / "scripts" / "device_run.sh").write_text((REPO / "scripts" / "device_run.sh").read_text())
    out = tmp_path / "out"
    out.mkdir()
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "OUT": str(out), "STEPS": "kernels_ab",
           "AB_ENV": "AB_TREE=ab_old;AB_TREE=.", "KERNEL_BUDGET": "5"}
    subprocess.run(["bash", "scripts/device_run.sh"], cwd=checkout, env=env, capture_output=True, text=True, timeout=120)
    runs = [line for line in (out / "log.txt").read_text().splitlines() if line.startswith("attention_sweep")]
    args = "['--sections', 'defaults', '--budget', '5']"
    assert runs == [f"attention_sweep old {args} kernels_ab0", f"attention_sweep new {args} kernels_ab1"], runs


def test_device_run_says_why_a_timed_run_printed_no_table(tmp_path):
    """device_run.sh's `exit_said`: nothing after a run that exited 0; otherwise the exit
    status, and for a timeout (124) the limit and why a first run may need more (it compiles
    every kernel) — in the output and the call's log."""
    script = (REPO / "scripts" / "device_run.sh").read_text()
    start = script.index("exit_said() {")
    function = script[start : script.index("\n}\n", start) + 3]
    log = tmp_path / "log.txt"
    calls = "exit_said 0 'ab 0' 100\nexit_said 124 'ab 1' 100\nexit_said 1 bench 300\n"
    out = subprocess.run(["bash", "-c", f"LOG={log}\n" + function + calls], capture_output=True, text=True, timeout=60, check=True).stdout
    lines = out.splitlines()
    assert len(lines) == 2 and lines[1] == "bench: exit 1", out
    assert lines[0].startswith("ab 1: exit 124 (timed out after 100 s;") and "compiles every kernel" in lines[0], out
    assert log.read_text() == out


def test_device_run_sends_the_triton_cache_back_and_restores_it(tmp_path):
    """device_run.sh's `send_triton_cache` (TRITON_CACHE_OUT=1) packs a kernel's metadata,
    cubin and PTX and the launchers' .so (not the other IR) into $OUT/tcache.tar.xz.NN;
    `restore_triton_cache` unpacks those files, carried as tcache/, into the next machine's
    cache at the same path (a Triton group file names its members by absolute path)."""
    functions = _device_run_functions("restore_triton_cache", "send_triton_cache")
    cache, out, checkout = tmp_path / "cache", tmp_path / "out", tmp_path / "checkout"
    kept = ["abc/_gate_up_kernel.json", "abc/__grp___gate_up_kernel.json", "abc/_gate_up_kernel.cubin", "abc/_gate_up_kernel.ptx",
            "def/__triton_launcher.so"]
    for name in kept + ["abc/_gate_up_kernel.ttir", "abc/_gate_up_kernel.llir", "abc/_gate_up_kernel.source"]:
        (cache / name).parent.mkdir(parents=True, exist_ok=True)
        (cache / name).write_bytes(name.encode() * 1000)
    out.mkdir()
    env = {"PATH": "/usr/bin:/bin", "OUT": str(out), "LOG": str(out / "log.txt"), "TRITON_CACHE": str(cache)}
    run = lambda script, cwd, **more: subprocess.run(["bash", "-c", functions + script], cwd=cwd, env={**env, **more},  # noqa: E731
                                                     capture_output=True, text=True, timeout=60, check=True).stdout
    assert run("send_triton_cache", tmp_path) == ""  # off unless asked for
    assert "triton cache sent back: 1 kernels" in run("send_triton_cache", tmp_path, TRITON_CACHE_OUT="1")
    parts = sorted(p.name for p in out.iterdir() if p.name.startswith("tcache"))
    assert parts == ["tcache.tar.xz.00"], parts
    (checkout / "tcache").mkdir(parents=True)
    (checkout / "tcache" / parts[0]).write_bytes((out / parts[0]).read_bytes())
    assert run("restore_triton_cache", tmp_path) == ""  # nothing carried: nothing done
    shutil.rmtree(cache)
    assert "1 compiled kernels restored" in run("restore_triton_cache", checkout)
    restored = sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file())
    assert restored == sorted(kept), restored
    assert all((cache / name).read_bytes() == name.encode() * 1000 for name in kept)
