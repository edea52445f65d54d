"""Config parsing: roles from the fields, and one clear error naming the field for bad configs."""

import copy
import json
from pathlib import Path

import pytest

from dsv4.cache.reference_configs import released_v4_config, released_v41_config
from dsv4.config import ConfigError, EngineConfig, load_config, parse_config
from dsv4.model.make_tiny import tiny_config


def test_released_v41_roles_follow_the_fields():
    cfg = parse_config(released_v41_config())
    kinds = {r.index: r.kind for r in cfg.roles}
    assert [i for i, k in kinds.items() if k == "full"] == [2, 8, 14, 20]
    assert [i for i, k in kinds.items() if k == "reindex"] == [24, 28, 32, 36]
    assert cfg.ced_split == 20 and cfg.roles[20].is_candidate_source
    assert all(cfg.roles[i].uses_candidates for i in (24, 28, 32, 36))
    assert cfg.roles[23].index_source == 20 and cfg.roles[27].index_source == 24
    assert [r.index for r in cfg.roles if r.engram] == [1, 14]
    assert cfg.weight_block_size == 32 and cfg.dspark_target_layer_ids == (37, 38, 39)


def test_released_v4_roles():
    cfg = parse_config(released_v4_config())
    assert cfg.weight_block_size == 128 and cfg.hash_layers == (0, 1, 2)
    assert [r.kind for r in cfg.roles[:5]] == ["window", "window", "csa", "hca", "csa"]


def test_roles_move_with_a_custom_schedule():
    raw = tiny_config("v41")
    raw["text_config"]["kv_source_layer_ids"] = [2, 3, 6]
    raw["text_config"]["index_source_layer_ids"] = [2, 3, 6, 9]
    cfg = parse_config(raw)
    assert cfg.roles[3].kind == "full" and cfg.roles[4].kv_source == 3 and cfg.roles[9].kind == "reindex"


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda c: c.update(architectures=["LlamaForCausalLM"], model_type="llama"), "unknown architecture"),
        (lambda c: c["text_config"].pop("hidden_size"), "'hidden_size'"),
        (lambda c: c["text_config"].update(hidden_size="32"), "'hidden_size' must be int"),
        (lambda c: c["text_config"].update(kv_source_layer_ids=[0, 2]), "'kv_source_layer_ids'"),
        (lambda c: c["text_config"].update(compress_ratios=[0, 0, 2]), "'compress_ratios'"),
        (lambda c: c["text_config"].update(engram_num_embeddings=[5]), "'engram_num_embeddings'"),
        (lambda c: c["text_config"].update(candidate_source_layer_id=3), "'candidate_source_layer_id'"),
        (lambda c: c.pop("quantization_config"), "'quantization_config'"),
        (lambda c: c["quantization_config"].update(weight_block_size=[32, 16]), "weight_block_size"),
        (lambda c: c["text_config"].update(scoring_func="softmax"), "'scoring_func'"),
    ],
)
def test_bad_configs_name_the_field(mutate, field):
    raw = copy.deepcopy(tiny_config("v41"))
    mutate(raw)
    with pytest.raises(ConfigError, match=field):
        parse_config(raw)


def test_missing_and_invalid_config_files(tmp_path: Path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="invalid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config("v4")))
    assert load_config(tmp_path).arch == "v4"


@pytest.mark.parametrize("kwargs, field", [
    (dict(dtype="float16"), "dtype"), (dict(block_size=0), "block_size"), (dict(scheduling_policy="lifo"), "scheduling_policy"),
    (dict(max_num_seqs=0), "max_num_seqs"), (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"), (dict(device="tpu"), "device"),
])
def test_engine_options_are_validated(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**kwargs)
