"""GPU correctness check (device run): the CUDA path (compact FP8 weights, bf16 and fp32)
against the golden reference: prompt logits and greedy tokens. Writes $OUT/gpu_golden.json."""

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from dsv4.engine.sampling_params import SamplingParams
from dsv4.llm import LLM


def main(folders: list[str]) -> int:
    results = {}
    for folder in folders:
        ref = load_file(Path(folder) / "golden.safetensors")
        prompts = [ref[f"prompt{i}.input_ids"].tolist() for i in range(5)]
        for dtype in ("float32", "bfloat16"):
            llm = LLM(folder, device="cuda", dtype=dtype, block_size=16, kv_cache_memory=256 << 20, swa_bounded_replay=False)
            logits = llm.prompt_logits(prompts)
            diffs = [float((lg[:, ref["vocab_ids"]] - ref[f"prompt{i}.prefill.logits"]).abs().max()) for i, lg in enumerate(logits)]
            outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
            same = [o.token_ids == ref[f"prompt{i}.greedy.tokens"].tolist() for i, o in enumerate(outs)]
            results[f"{Path(folder).name}/{dtype}"] = {"max_logit_diff_per_prompt": diffs, "greedy_identical": same}
            print(Path(folder).name, dtype, "max logit diff", [f"{d:.2e}" for d in diffs], "greedy identical", same, flush=True)
            del llm
            torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_golden.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
