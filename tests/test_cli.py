"""The CLI turns bad models and options into one clear error line, not a traceback."""

import subprocess
import sys

from safetensors.torch import load_file, save_file

from dsv4.model.make_tiny import write_tiny_checkpoint


def _dsv4(*args):
    return subprocess.run([sys.executable, "-m", "dsv4.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_on_a_corrupted_checkpoint_names_the_tensor(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "t", "v4", seed=0)
    tensors = load_file(folder / "model.safetensors")
    del tensors["layers.3.attn.wkv.weight"]
    tensors["layers.2.attn.wq_a.weight"] = tensors["layers.2.attn.wq_a.weight"][:10]
    save_file(tensors, folder / "model.safetensors")
    run = _dsv4("generate", "--model", str(folder), "hello")
    assert run.returncode == 2
    assert "layers.3.attn.wkv.weight" in run.stderr and "layers.2.attn.wq_a.weight" in run.stderr
    assert "Traceback" not in run.stderr


def test_bad_engine_option_and_missing_model(tmp_path):
    run = _dsv4("generate", "--model", str(tmp_path), "hello")
    assert run.returncode == 2 and "config.json" in run.stderr and "Traceback" not in run.stderr


def test_inspect_shows_890_bytes_per_token_for_v41():
    run = _dsv4("inspect", "v41")
    assert run.returncode == 0, run.stderr
    assert "890.0" in run.stdout and "CED split" in run.stdout
