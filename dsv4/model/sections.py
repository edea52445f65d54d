"""Named sections of a forward: the components a benchmark breakdown reports (attention,
indexer, compressor, moe, mhc, engram, head; dsv4.bench.roofline.COMPONENTS).

Each `section(name)` is a profiler range and, while `timing()` collects, a pair of time
stamps at its edges: CUDA events on the GPU (recorded in stream order, so they time the GPU's
work, not the host's launches), the wall clock on CPU. Events recorded while a CUDA graph is
being captured become nodes of the graph (`external=True`), so one replay times every section
of a captured step with no host in the way.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from torch.profiler import record_function

_marks: list | None = None  # (section, entering, stamp) while timing() collects
_on_cuda = False
_captured_only = False


@contextmanager
def section(name: str):
    with record_function("dsv4." + name):
        _mark(name, True)
        try:
            yield
        finally:
            _mark(name, False)


def _mark(name: str, entering: bool) -> None:
    if _marks is None:
        return
    if _on_cuda:
        capturing = torch.cuda.is_current_stream_capturing()
        if _captured_only and not capturing:
            return
        stamp = torch.cuda.Event(enable_timing=True, external=capturing)
        stamp.record()
    else:
        stamp = time.perf_counter()
    _marks.append((name, entering, stamp))


@contextmanager
def timing(device: torch.device, captured_only: bool = False):
    """Collect the section stamps of the work issued inside on `device`; yields the list they
    go to. `captured_only`: only stamps recorded into a CUDA graph being captured (not those
    of the warm-up runs before the capture)."""
    global _marks, _on_cuda, _captured_only
    saved = _marks, _on_cuda, _captured_only
    _marks, _on_cuda, _captured_only = [], torch.device(device).type == "cuda", captured_only
    try:
        yield _marks
    finally:
        _marks, _on_cuda, _captured_only = saved


def exclusive_ms(marks: list) -> dict[str, float]:
    """Milliseconds per section name, each without the sections nested in it (the indexer
    runs inside attention), summed over every time it ran. CUDA stamps must have completed
    (synchronise first)."""
    def ms(a, b) -> float:
        return a.elapsed_time(b) if isinstance(a, torch.cuda.Event) else (b - a) * 1e3

    totals: dict[str, float] = {}
    stack: list[list] = []  # [name, enter stamp, time of nested sections]
    for name, entering, stamp in marks:
        if entering:
            stack.append([name, stamp, 0.0])
            continue
        open_name, start, nested = stack.pop()
        if open_name != name:
            raise ValueError(f"sections: {name!r} closed while {open_name!r} was open")
        inclusive = ms(start, stamp)
        totals[name] = totals.get(name, 0.0) + inclusive - nested
        if stack:
            stack[-1][2] += inclusive
    if stack:
        raise ValueError(f"sections: {stack[-1][0]!r} never closed")
    return totals
