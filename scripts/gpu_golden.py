"""GPU correctness check (device run) on the golden sets, end to end through the engine:

* fp32 on CUDA (compact FP8 weights, reference ops) against the golden reference: prompt
  logits and greedy tokens;
* bf16: the reference ops, the fast path eager (--enforce-eager, synchronous scheduling), with
  CUDA graphs (and async scheduling, their default) and with graphs but synchronous
  scheduling. Neither may change outputs: greedy tokens (and the decode logits) of the fast
  path are identical in all three; with FP8 activations (V4.1), eager and graphs are identical too;
  with FP4 experts (graphs) the outputs are those of the FP8 experts, bit for bit. The fast path against the bf16 reference ops:
  logit distance and greedy agreement (bf16 flips selections on these random tiny models,
  see tests/model/test_golden.py::test_bf16_within_bf16_noise).

Writes $OUT/gpu_golden.json; exits 1 if graphs change any greedy token."""

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from dsv4.config import load_config
from dsv4.engine.sampling_params import SamplingParams
from dsv4.llm import LLM

ENGINE = dict(device="cuda", block_size=16, kv_cache_memory=256 << 20, swa_bounded_replay=False, max_model_len=1024)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)


def _run(folder: str, prompts, **options):
    llm = LLM(folder, **dict(ENGINE, **options))
    logits = llm.prompt_logits(prompts)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    fast = llm.engine.model.fast
    del llm
    torch.cuda.empty_cache()
    return logits, outs, fast


def main(folders: list[str]) -> int:
    results, failed = {}, False
    for folder in folders:
        name = Path(folder).name
        ref = load_file(Path(folder) / "golden.safetensors")
        prompts = [ref[f"prompt{i}.input_ids"].tolist() for i in range(5)]
        logits, outs, _ = _run(folder, prompts, dtype="float32")
        diffs = [float((lg[:, ref["vocab_ids"]] - ref[f"prompt{i}.prefill.logits"]).abs().max()) for i, lg in enumerate(logits)]
        same = [o.token_ids == ref[f"prompt{i}.greedy.tokens"].tolist() for i, o in enumerate(outs)]
        results[f"{name}/float32"] = {"max_logit_diff_per_prompt": diffs, "greedy_identical": same}
        print(name, "float32 reference ops: max logit diff", [f"{d:.2e}" for d in diffs], "greedy identical", same, flush=True)

        variants = [("reference", {"fast_path": False}), ("fast_eager", {"enforce_eager": True}), ("fast_graphs", {}),
                    ("fast_graphs_sync", {"async_scheduling": False}), ("fp4_graphs", {"fp4_experts": True})]
        fp8 = load_config(folder).arch == "v41"  # FP8 activations: V4.1 only
        if fp8:
            variants += [("fp8_eager", {"enforce_eager": True, "fp8_activations": True}), ("fp8_graphs", {"fp8_activations": True})]
        runs = {label: _run(folder, prompts, dtype="bfloat16", **opts) for label, opts in variants}
        entry = {"fast_path_on": runs["fast_graphs"][2]}
        if not runs["fast_graphs"][2]:
            print(name, "bfloat16: this config runs the reference path only", flush=True)
        else:
            eager, graphs, graphs_sync = runs["fast_eager"][1], runs["fast_graphs"][1], runs["fast_graphs_sync"][1]
            graph_same = [a.token_ids == b.token_ids == c.token_ids for a, b, c in zip(eager, graphs, graphs_sync)]
            logprobs = lambda o: [x.logprob for x in o.outputs[0].logprobs]
            lp_same = [logprobs(a) == logprobs(b) == logprobs(c) for a, b, c in zip(eager, graphs, graphs_sync)]
            failed |= not all(graph_same)
            ref_logits = runs["reference"][0]
            dist = [float((a - b).abs().mean()) for a, b in zip(runs["fast_eager"][0], ref_logits)]
            agree = [sum(x == y for x, y in zip(a.token_ids, r.token_ids)) for a, r in zip(eager, runs["reference"][1])]
            entry.update(graphs_vs_eager_greedy_identical=graph_same, graphs_vs_eager_logprobs_identical=lp_same,
                         fast_vs_reference_mean_logit_distance=dist, fast_vs_reference_greedy_agreement_of_12=agree)
            print(name, "bfloat16: graphs (async) == graphs (sync) == eager greedy", graph_same, "logprobs", lp_same, flush=True)
            print(name, "bfloat16: fast vs reference ops mean |logit diff|", [f"{d:.3f}" for d in dist], "greedy agreement /12", agree, flush=True)
            if fp8:  # FP8 activations: graphs may not change outputs either
                e8, g8 = runs["fp8_eager"][1], runs["fp8_graphs"][1]
                fp8_same = [a.token_ids == b.token_ids and logprobs(a) == logprobs(b) for a, b in zip(e8, g8)]
                failed |= not all(fp8_same)
                fp8_dist = [float((a - b).abs().mean()) for a, b in zip(runs["fp8_eager"][0], runs["fast_eager"][0])]
                entry.update(fp8_graphs_vs_eager_identical=fp8_same, fp8_vs_bf16_mean_logit_distance=fp8_dist)
                print(name, "bfloat16 + FP8 activations: graphs == eager (greedy and logprobs)", fp8_same,
                      "mean |logit diff| to unquantised", [f"{d:.3f}" for d in fp8_dist], flush=True)
            # FP4 experts dequantise to the FP8 conversion's values: the same outputs, bit for bit
            fp4_same = [a.token_ids == b.token_ids and logprobs(a) == logprobs(b) for a, b in zip(runs["fp4_graphs"][1], graphs)]
            fp4_same_logits = all(torch.equal(a, b) for a, b in zip(runs["fp4_graphs"][0], runs["fast_graphs"][0]))
            failed |= not (all(fp4_same) and fp4_same_logits)
            entry.update(fp4_vs_fp8_experts_identical=fp4_same, fp4_vs_fp8_prompt_logits_identical=fp4_same_logits)
            print(name, "bfloat16 + FP4 experts: == FP8 experts (greedy and logprobs)", fp4_same, "prompt logits", fp4_same_logits, flush=True)
        results[f"{name}/bfloat16"] = entry
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_golden.json").write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
