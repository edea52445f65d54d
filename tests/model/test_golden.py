"""The model against the golden reference (Hugging Face's implementation, fp32 on CPU):
prompt logits, selections, greedy continuations, chunked / token-by-token paths, ragged
batches, bf16 within bf16 noise. Tolerances follow golden/README.md."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dsv4.engine.sampling_params import SamplingParams
from dsv4.llm import LLM
from dsv4.model.batch import ForwardBatch

SHARED = Path(os.environ.get("DSV4_SHARED", Path(__file__).resolve().parents[2] / ".." / "shared"))
GOLDEN = SHARED / "golden"
STRICT = ["v4-tiny-a", "v41-tiny-a-nofp8kv"]
ALL = STRICT + ["v41-tiny-a"]
ENGINE = dict(block_size=16, kv_cache_memory=64 << 20, max_num_seqs=8, swa_bounded_replay=False)


@pytest.fixture(scope="module", params=ALL)
def golden(request):
    folder = GOLDEN / request.param
    if not folder.is_dir():
        pytest.skip(f"golden set {folder} not found (set DSV4_SHARED)")
    ref = load_file(folder / "golden.safetensors")
    meta = json.loads((folder / "golden.json").read_text())
    llm = LLM(folder, **ENGINE)
    return request.param, llm, ref, meta


def _prompts(ref):
    return [ref[f"prompt{i}.input_ids"].tolist() for i in range(5)]


def _spread_free(meta, i):
    return meta["agreement_fp32"]["per_prompt"][i]["positions_with_path_spread_gt_1e-4"] == 0


def _check_logits(name, meta, ref, i, part, logits, one_shot=True):
    cols = ref["vocab_ids"]
    diff = (logits[:, cols] - ref[f"prompt{i}.{part}.logits"]).abs()
    if name in STRICT or (one_shot and _spread_free(meta, i)):
        assert diff.max() <= 5e-4, f"{name} prompt{i} {part}: max logit diff {diff.max():.3e}"
    else:
        # FP8 window-KV rounding flips (golden/README.md): a rounding-order change (another
        # path, or another implementation) moves one FP8 step in one KV element, which shows
        # as differences of the size of the reference's own path spread (>= 1e-2 here).
        spread = max(ref[f"prompt{i}.{part}.hf_path_spread"].max().item(), 1e-2)
        assert diff.max() <= 2 * spread + 5e-4, f"{name} prompt{i} {part}: {diff.max():.3e} vs spread {spread:.3e}"


def test_prompt_logits_match_reference(golden):
    name, llm, ref, meta = golden
    logits = llm.prompt_logits(_prompts(ref))
    for i, lg in enumerate(logits):
        _check_logits(name, meta, ref, i, "prefill", lg)
        assert torch.equal(lg.argmax(-1), ref[f"prompt{i}.prefill.argmax"]), f"{name} prompt{i}: argmax differs"
        lse = torch.logsumexp(lg, -1)
        assert (lse - ref[f"prompt{i}.prefill.logsumexp"]).abs().max() <= (5e-4 if name in STRICT or _spread_free(meta, i) else 0.2)


def test_ragged_batch_equals_each_alone(golden):
    _, llm, ref, _ = golden
    prompts = _prompts(ref)
    together = llm.prompt_logits(prompts)
    for p, lg in zip(prompts, together):
        alone = llm.prompt_logits([p])[0]
        assert torch.equal(alone, lg)


def test_greedy_continuations_are_token_identical(golden):
    name, llm, ref, _ = golden
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(_prompts(ref), params, use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.token_ids == ref[f"prompt{i}.greedy.tokens"].tolist(), f"{name} prompt{i}"
    assert llm.cache_stats()["blocks_used"] == 0


def _forward(llm, ids, start, trace=None):
    eng = llm.engine
    n = len(ids) - start
    prev = [[ids[start - 1 - s] if start - 1 - s >= 0 else -1 for s in range(3)]]
    batch = ForwardBatch(
        input_ids=torch.tensor(ids[start:]), positions=torch.arange(start, len(ids)), start_pos=[start], num_tokens=[n],
        slots=[0], block_tables=torch.arange(64).unsqueeze(0), prev_tokens=torch.tensor(prev), trace=trace,
    )
    return eng.model.logits(eng.model.forward(batch, eng.storage))


@pytest.mark.parametrize("chunk", [7, 1])
def test_chunked_and_stepwise_paths_match(golden, chunk):
    """The same prompt fed `chunk` tokens per forward, then the greedy tokens one by one."""
    name, llm, ref, meta = golden
    for i in (1, 3):
        ids = ref[f"prompt{i}.input_ids"].tolist()
        pieces = []
        for s in range(0, len(ids), chunk):
            pieces.append(_forward(llm, ids[: s + chunk], s))
        _check_logits(name, meta, ref, i, "prefill", torch.cat(pieces), one_shot=False)
        greedy = ref[f"prompt{i}.greedy.tokens"].tolist()
        steps = [_forward(llm, ids + greedy[: t + 1], len(ids) + t) for t in range(12)]
        _check_logits(name, meta, ref, i, "greedy", torch.cat(steps), one_shot=False)


def test_selections_match_reference(golden):
    """Indexer top-k, candidate blocks and routed experts of the one-shot path are the same sets."""
    name, llm, ref, _ = golden
    for i in (2, 4):
        ids = ref[f"prompt{i}.input_ids"].tolist()
        trace: dict = {}
        _forward(llm, ids, 0, trace)
        checked = 0
        for key, values in trace.items():
            golden_key = f"prompt{i}.prefill.sel.{key}"
            if golden_key not in ref:
                continue
            mine = torch.cat(values).sort(-1).values
            assert torch.equal(mine, ref[golden_key].sort(-1).values), f"{name} prompt{i} {key}"
            checked += 1
        assert checked == sum(1 for k in ref if k.startswith(f"prompt{i}.prefill.sel."))


@pytest.mark.parametrize("name,prompt_ids,max_mean", [("v4-tiny-a", range(5), 0.35), ("v41-tiny-a-nofp8kv", range(2), 0.8)])
def test_bf16_within_bf16_noise(name, prompt_ids, max_mean):
    """bf16 keeps 8 mantissa bits, far coarser than the 1e-5 relative top-k margins of these
    random tiny models (golden.json topk_margins): bf16 flips expert and index selections,
    V4.1's FP4 indexer queries/keys most of all, and each flip moves later logits by O(1).
    So: mean logit distance small, and the argmax agrees wherever the fp32 top-1 leads by > 1."""
    folder = GOLDEN / name
    if not folder.is_dir():
        pytest.skip("golden sets not found")
    ref = load_file(folder / "golden.safetensors")
    llm = LLM(folder, dtype="bfloat16", **ENGINE)
    logits = llm.prompt_logits([ref[f"prompt{i}.input_ids"].tolist() for i in prompt_ids])
    for i, lg in zip(prompt_ids, logits):
        diff = (lg[:, ref["vocab_ids"]] - ref[f"prompt{i}.prefill.logits"]).abs()
        assert diff.mean() < max_mean, f"{name} prompt{i}: mean logit distance {diff.mean():.3f}"
        top = ref[f"prompt{i}.prefill.top16_logits"]
        clear = (top[:, 0] - top[:, 1]) > 1.0
        agree = (lg.argmax(-1) == ref[f"prompt{i}.prefill.argmax"])[clear].float().mean()
        assert clear.sum() == 0 or agree >= 0.85, f"{name} prompt{i}: bf16 argmax agreement {agree:.0%}"
