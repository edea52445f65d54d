"""Test-wide settings: one intra-op thread (the tiny models' matmuls gain nothing from more,
and CI machines have two cores shared with the test process itself)."""

import torch

torch.set_num_threads(1)
