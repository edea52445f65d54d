"""V4 against the released transformers DeepseekV4ForCausalLM (5.23) on fresh random tiny
checkpoints: the same dequantised fp32 weights, the same prompts, logits and greedy tokens."""

import pytest
import torch

from dsv4.config import load_config
from dsv4.engine.sampling_params import SamplingParams
from dsv4.llm import LLM
from dsv4.model.make_tiny import write_tiny_checkpoint
from dsv4.model.weights import load_weights
from test_make_tiny import _hf_v4_state

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("seed", [11, 12])
def test_v4_logits_match_transformers(tmp_path, seed):
    folder = write_tiny_checkpoint(tmp_path / f"v4-{seed}", "v4", seed=seed)
    hf_cfg = transformers.DeepseekV4Config.from_pretrained(folder)
    hf_cfg._attn_implementation = "eager"
    hf = transformers.DeepseekV4ForCausalLM(hf_cfg).float().eval()
    state = _hf_v4_state(load_weights(folder, load_config(folder), dtype=torch.float32, progress=False).tensors)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("inv_freq" in m for m in missing), (missing, unexpected)
    g = torch.Generator().manual_seed(seed)
    # <= 19 tokens: at most 4 CSA entries (ratio 4), so the index top-4 takes every visible
    # entry and the ReLU-score ties of random weights cannot make selections differ
    prompts = [torch.randint(100, 120000, (n,), generator=g).tolist() for n in (5, 12, 19)]
    llm = LLM(folder, block_size=16, kv_cache_memory=32 << 20, swa_bounded_replay=False)
    ours = llm.prompt_logits(prompts)
    for ids, mine in zip(prompts, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        assert (mine - ref).abs().max() < 5e-4, f"seed {seed}, {len(ids)} tokens: {(mine - ref).abs().max():.2e}"
    outs = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    with torch.no_grad():
        ref_tokens = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=6, do_sample=False)[0, len(prompts[0]):].tolist()
    assert outs[0].token_ids == ref_tokens
