"""Load a released DeepSeek-V4.1-Flash / V4-Flash checkpoint into tensors keyed by release name.

Validation comes before any tensor data is read: every shard header is parsed by hand (it is a
length-prefixed JSON block) and the whole inventory is checked against `checkpoint_spec(cfg)`.
All problems (missing, unexpected, wrong shape, wrong dtype, partial draft stage) are reported
together in one `CheckpointError`, so a bad download or a wrong config is diagnosed in one run
instead of one tensor at a time. Only then are tensors read, lazily (one `safe_open` per shard,
one tensor at a time), decoded and moved to the target device.

Decoded forms (MODEL.md section 4, golden/README.md "Weight storage"):

* PLAIN F32 stays float32 whatever `dtype` is (mHC parameters, attention sinks, router biases,
  V4 `ape` / `hc_head_*` are fp32 islands, as HF keeps them); BF16 is cast to `dtype`;
  I64 / I32 (`tid2eid`) become int64.
* FP8 dense `X.weight` + `X.scale`: dequantised exactly (`fp8 * 2**(e - 127)` per
  `weight_block_size` tile, in fp32, then cast to `dtype`), no `X.scale` entry; with
  `compact=True` the float8_e4m3fn codes and the uint8 exponent bytes are kept as stored
  (bytes in the FP8 kernels' range, `quant.check_fp8_scales`).
* FP4 routed experts: dequantised to `dtype` [out, in]; with `compact=True` converted
  losslessly to FP8 (float8_e4m3fn [out, in] + uint8 exponents [out, in/32], checked as
  above) for the FP8 expert kernels, or with `cfg.fp4_experts` kept FP4 in the kernels'
  nibble order (uint8 [out, in/2], `quant.fp4_kernel_layout`) + the same exponents.
* Engram tables (`layers.L.engram.embed.weight` / `.scale`): always kept compact (FP8 rows +
  uint8 exponents per 32 channels): the model gathers a few rows per token and dequantises
  only those; the released tables are about 92 GiB each.
"""

from __future__ import annotations

import json
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
)
from safetensors import SafetensorError, safe_open

from dsv4.config import ModelConfig
from dsv4.model import quant
from dsv4.model.spec import (
    ENGRAM,
    FP4,
    FP8,
    IGNORED_PREFIXES,
    PLAIN,
    SCALE,
    TensorSpec,
    checkpoint_spec,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Bytes per element of the safetensors dtypes, to check each header entry's byte extent.
_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
# The 0xFF check on E8M0 scales runs in chunks so a 3 GB engram scale needs no 3 GB mask.
_SCALE_CHECK_CHUNK = 1 << 26


class CheckpointError(ValueError):
    """The checkpoint does not match the config, or one of its files is damaged.

    `problems` holds one line per issue (naming the tensor or the file, what was expected and
    what was found); the message lists them all."""

    def __init__(self, problems: list[str], summary: str = "checkpoint cannot be loaded"):
        self.problems = list(problems)
        body = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{summary} ({len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}):\n{body}")


@dataclass
class LoadedWeights:
    """What `load_weights` returns.

    tensors: decoded tensors keyed by release name (no `model.` prefix); see the module
        docstring for the form of each storage format.
    draft_stages: how many draft stages (`mtp.0` .. `mtp.{k-1}`: V4's MTP layer, V4.1's
        DSpark stages) were in the checkpoint and were loaded; 0 when the file has none. Each
        present stage is complete (validated); whether fewer stages than the config's
        `num_nextn_predict_layers` are usable is the draft model's decision.
    """

    tensors: dict[str, torch.Tensor]
    draft_stages: int


@dataclass(frozen=True)
class _Entry:
    """One tensor as declared by a shard header."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    begin: int  # offset of the data inside the file's data section (for read ordering)
    nbytes: int


# ------------------------------------------------------------------------------ shard headers


def _read_header(path: Path) -> tuple[dict[str, _Entry], list[str]]:
    """Parse one safetensors header without reading tensor data.

    Returns the entries and the file-level problems (unreadable, malformed, truncated). The
    truncation check compares the file size with the largest data offset the header declares:
    `safe_open` maps the file lazily and would only fail (or read garbage) when the missing
    bytes are touched."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                return {}, [f"{path}: unreadable header (file has {size} bytes, fewer than the 8-byte length prefix)"]
            n = int.from_bytes(prefix, "little")
            if 8 + n > size:
                return {}, [f"{path}: unreadable header (declares {n} header bytes, file has {size} bytes in all)"]
            raw = fh.read(n)
        header = json.loads(raw)
    except FileNotFoundError:
        return {}, [f"{path}: shard file not found"]
    except OSError as exc:
        return {}, [f"{path}: cannot read ({exc})"]
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return {}, [f"{path}: unreadable header (not valid JSON: {exc})"]
    if not isinstance(header, dict):
        return {}, [f"{path}: unreadable header (not a JSON object)"]

    entries: dict[str, _Entry] = {}
    problems: list[str] = []
    data_end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            valid = (
                isinstance(dtype, str)
                and all(isinstance(d, int) and d >= 0 for d in shape)
                and isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end
            )
        except (KeyError, TypeError, ValueError):
            valid = False
        if not valid:
            problems.append(f"{path}: unreadable header (malformed entry for tensor {name!r}: {info!r})")
            continue
        numel = 1
        for d in shape:
            numel *= d
        if dtype in _ITEMSIZE and numel * _ITEMSIZE[dtype] != end - begin:
            problems.append(
                f"{path}: tensor {name}: header declares {end - begin} data bytes, "
                f"but {dtype} {list(shape)} needs {numel * _ITEMSIZE[dtype]}"
            )
        data_end = max(data_end, end)
        entries[name] = _Entry(name, dtype, shape, path, begin, end - begin)
    if 8 + n + data_end > size:
        problems.append(
            f"{path}: truncated shard (header declares {8 + n + data_end} bytes up to the end of its last tensor, "
            f"the file has {size})"
        )
    return entries, problems


def _read_inventory(model_dir: Path) -> dict[str, _Entry]:
    """Every tensor of the checkpoint with the shard that holds it, from the index (sharded
    checkpoints) or the single `model.safetensors`. Raises CheckpointError for file problems."""
    index_path = model_dir / INDEX_FILE
    problems: list[str] = []
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map must map tensor names to file names")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError([f"{index_path}: unreadable index ({type(exc).__name__}: {exc})"]) from None
        shards = sorted(set(weight_map.values()))
    elif (model_dir / SINGLE_FILE).is_file():
        weight_map, shards = None, [SINGLE_FILE]
    else:
        raise CheckpointError([f"{model_dir}: neither {INDEX_FILE} nor {SINGLE_FILE} found"])

    entries: dict[str, _Entry] = {}
    for shard in shards:
        found, file_problems = _read_header(model_dir / shard)
        problems += file_problems
        for name, entry in found.items():
            if name in entries:
                problems.append(f"{name}: stored twice ({entries[name].file.name} and {shard})")
            elif weight_map is not None and weight_map.get(name) != shard:
                problems.append(f"{name}: found in {shard} but {INDEX_FILE} maps it to {weight_map.get(name)!r}")
            else:
                entries[name] = entry
    if weight_map is not None and not problems:
        for name, shard in weight_map.items():
            if name not in entries:
                problems.append(f"{name}: {INDEX_FILE} maps it to {shard}, which does not contain it")
    if problems:
        raise CheckpointError(problems, f"damaged checkpoint files in {model_dir}")
    return entries


# ------------------------------------------------------------------------------ validation


def _fmt_spec(spec: TensorSpec) -> str:
    return f"{'/'.join(spec.dtypes)} {list(spec.shape)}"


def _validate(spec: dict[str, TensorSpec], entries: dict[str, _Entry]) -> tuple[list[str], int]:
    """All mismatches between the inventory and the spec, and the number of draft stages present."""
    problems: list[str] = []
    for name, e in entries.items():
        if name.startswith(IGNORED_PREFIXES):
            continue
        s = spec.get(name)
        if s is None:
            problems.append(f"{name}: unexpected tensor ({e.dtype} {list(e.shape)} in {e.file.name})")
            continue
        if e.dtype not in s.dtypes:
            problems.append(f"{name}: wrong dtype: expected {'/'.join(s.dtypes)}, got {e.dtype}")
        if e.shape != s.shape:
            problems.append(f"{name}: wrong shape: expected {list(s.shape)}, got {list(e.shape)}")

    groups: dict[str, list[TensorSpec]] = defaultdict(list)
    for s in spec.values():
        groups[s.group].append(s)
    present_stages = []
    for group, members in groups.items():
        missing = [s for s in members if s.name not in entries]
        if group == "model":
            problems += [f"{s.name}: missing (expected {_fmt_spec(s)})" for s in missing]
        elif len(missing) < len(members):  # the stage is (at least partly) present
            problems += [
                f"{s.name}: missing (expected {_fmt_spec(s)}); draft stage {group} is only partly present "
                f"({len(members) - len(missing)} of {len(members)} tensors): a stage must be complete or absent"
                for s in missing
            ]
            present_stages.append(int(group.split(".", 1)[1]))
    present_stages.sort()
    for k in range(len(present_stages)):
        if k not in present_stages:
            problems.append(
                f"mtp.{k}: draft stage missing while later stage(s) {[f'mtp.{j}' for j in present_stages if j > k]} "
                "are present (each stage feeds the next)"
            )
            break
    return problems, len(present_stages)


# ------------------------------------------------------------------------------ decoding


def _check_scale_bytes(scale: torch.Tensor, name: str) -> None:
    """Reject the E8M0 NaN byte on scales kept compact (the dequantisers check it themselves)."""
    flat = quant.e8m0_bytes(scale).reshape(-1)
    for start in range(0, flat.numel(), _SCALE_CHECK_CHUNK):
        if bool((flat[start : start + _SCALE_CHECK_CHUNK] == 0xFF).any()):
            raise quant.FormatError(f"{name}: E8M0 scale byte 0xFF (NaN) is not a valid scale")


def _decode(
    spec: TensorSpec, weight: torch.Tensor, scale: torch.Tensor | None, cfg: ModelConfig, dtype: torch.dtype, compact: bool
) -> dict[str, torch.Tensor]:
    """The output entries of one stored tensor (and its scale), per the module docstring."""
    name = spec.name
    if spec.fmt == PLAIN:
        if weight.dtype == torch.float32:
            return {name: weight}
        if weight.is_floating_point():
            return {name: weight.to(dtype)}
        return {name: weight.to(torch.int64)}
    base = name.removesuffix(".weight")
    scale_name = f"{base}.scale"
    if spec.fmt == ENGRAM or (compact and spec.fmt == FP8):
        _check_scale_bytes(scale, scale_name)
        if spec.fmt == FP8:  # (engram rows are read by their own kernel, which takes any byte)
            quant.check_fp8_scales(scale, scale_name)
        return {name: weight, scale_name: quant.e8m0_bytes(scale)}
    if spec.fmt == FP8:
        return {name: quant.dequant_fp8_block(weight, scale, cfg.weight_block_size, base).to(dtype)}
    # FP4 routed expert (the last storage format of spec.py)
    if compact and cfg.fp4_experts:
        _check_scale_bytes(scale, scale_name)
        quant.check_fp4_scales(scale, scale_name)
        return {name: quant.fp4_kernel_layout(weight), scale_name: quant.e8m0_bytes(scale)}
    if compact:
        _check_scale_bytes(scale, scale_name)
        quant.check_fp8_scales(scale, scale_name)
        codes, exps = quant.fp4_expert_to_fp8(weight, scale)
        return {name: codes, scale_name: exps}
    return {name: quant.dequant_fp4_expert(weight, scale, base).to(dtype)}


def _progress(enabled: bool, total: int) -> tuple[Progress, TaskID]:
    """A byte-counting progress bar (a no-op when disabled), removed from the screen when done."""
    progress = Progress(
        TextColumn("loading weights"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
        disable=not enabled, transient=True,
    )
    return progress, progress.add_task("load", total=total)


def load_weights(
    model_dir: str | Path,
    cfg: ModelConfig,
    *,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    compact: bool = False,
    progress: bool = True,
) -> LoadedWeights:
    """Validate the checkpoint in `model_dir` against `checkpoint_spec(cfg)`, then load it.

    `dtype` is the floating dtype of BF16 tensors and of dequantised FP8/FP4 weights; F32
    tensors stay fp32. `compact=True` keeps dense FP8 weights as stored and converts FP4
    experts to FP8 (kept FP4 in the kernels' layout with `cfg.fp4_experts`), each with a
    uint8 `X.scale` entry. Raises CheckpointError listing every
    problem (inventory mismatches, damaged files, E8M0 NaN scales)."""
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
    model_dir = Path(model_dir)
    device = torch.device(device)
    entries = _read_inventory(model_dir)
    spec = checkpoint_spec(cfg)
    problems, draft_stages = _validate(spec, entries)
    if problems:
        raise CheckpointError(problems, f"{model_dir} does not match its config")

    # One unit per decoded tensor: the weight and, for quantised formats, its scale.
    units = []
    for s in spec.values():
        if s.fmt == SCALE or s.name not in entries:
            continue
        scale_name = s.name.removesuffix(".weight") + ".scale" if s.fmt in (FP8, FP4, ENGRAM) else None
        units.append((s, scale_name))
    units.sort(key=lambda u: (entries[u[0].name].file.name, entries[u[0].name].begin))
    total = sum(entries[s.name].nbytes + (entries[sc].nbytes if sc else 0) for s, sc in units)

    tensors: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        handles = {}

        def read(name: str) -> torch.Tensor:
            path = entries[name].file
            try:
                if path not in handles:
                    handles[path] = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
                return handles[path].get_tensor(name).to(device)
            except (SafetensorError, OSError) as exc:
                raise CheckpointError([f"{path}: cannot read tensor {name} ({exc})"]) from None

        bar, task = _progress(progress, total)
        with bar:
            for s, scale_name in units:
                weight = read(s.name)
                scale = read(scale_name) if scale_name else None
                try:
                    tensors.update(_decode(s, weight, scale, cfg, dtype, compact))
                except quant.FormatError as exc:
                    raise CheckpointError([f"{exc} (in {entries[s.name].file.name})"]) from None
                bar.advance(task, entries[s.name].nbytes + (entries[scale_name].nbytes if scale_name else 0))
    return LoadedWeights(tensors=tensors, draft_stages=draft_stages)
