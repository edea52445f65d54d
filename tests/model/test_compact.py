"""The GPU weight format (FP8 kept compact, FP4 experts converted to FP8) computes exactly what
the dequantised CPU format computes."""

import torch

from dsv4.cache.storage import KVCacheStorage
from dsv4.config import load_config
from dsv4.model.batch import ForwardBatch
from dsv4.model.make_tiny import write_tiny_checkpoint
from dsv4.model.model import Model
from dsv4.model.tokenizer import engram_token_map, load_tokenizer
from dsv4.model.weights import load_weights


def test_compact_weights_give_identical_logits(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "v41", "v41", seed=1)
    cfg = load_config(folder)
    token_map = engram_token_map(load_tokenizer(folder))
    ids = list(range(1000, 1040))
    outs = []
    for compact in (False, True):
        w = load_weights(folder, cfg, dtype=torch.float32, compact=compact, progress=False).tensors
        assert (w["layers.2.ffn.experts.0.w1.weight"].dtype == torch.float8_e4m3fn) == compact
        model = Model(cfg, w, dtype=torch.float32, token_map=token_map)
        cache = KVCacheStorage(cfg, num_slots=1, num_blocks=8, block_size=16, dtype=torch.float32)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids), positions=torch.arange(len(ids)), start_pos=[0], num_tokens=[len(ids)],
            slots=[0], block_tables=torch.arange(8).unsqueeze(0), prev_tokens=torch.full((1, 3), -1),
        )
        outs.append(model.logits(model.forward(batch, cache)))
    assert torch.equal(outs[0], outs[1])
