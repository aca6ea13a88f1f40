"""The Mesa drop-in: Mesa's policy files and layer names, on torchstash, without swapping layers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import torchstash as ts
import torchstash_quant.compat.mesa as ms

POLICY = """
on gelu:
    by_index: all
    enable: True
    level: 256
    ema_decay: 0.9
    by_index: 1
    enable: False
on fc:
    by_index: all
    enable: True
on layernorm:
    by_index: all
    enable: True
on softmax:
    by_index: all
    enable: True
on matmul:
    by_index: all
    enable: True
"""


class Block(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm = ms.LayerNorm(dim)
        self.qkv = ms.Linear(dim, 3 * dim, quant_groups=2)
        self.proj = nn.Linear(dim, dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.act = ms.GELU()
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)).softmax(-1)  # functional, as written in most models
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, n, c))
        return x + self.fc2(self.act(self.fc1(x)))


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    p = tmp_path / "policy.txt"
    p.write_text(POLICY)
    return p


def test_deploy_on_init_follows_the_policy(policy_file: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    x = torch.randn(8, 32, 64)
    model(x).square().mean().backward()
    ref = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    keys = list(model.state_dict())
    lines: list[str] = []
    ms.policy.convert_by_num_groups(model, 4)
    handle = ms.policy.deploy_on_init(model, policy_file, verbose=lines.append)
    assert list(model.state_dict()) == keys and isinstance(model[0].act, ms.GELU)
    model(x).square().mean().backward()
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    rows = handle.tally.rows
    assert rows["0.act"].compressed == 1 and rows["1.act"].compressed == 0  # GELU index 1 off
    assert rows["0.norm"].compressed >= 1 and rows["0.fc1"].compressed == 1
    attention = rows["0"]  # the functional matmuls and softmax of block 0
    assert attention.compressed >= 3 and {"matmul", "softmax"} <= set(attention.ops)
    assert torch.nn.functional.cosine_similarity(ref, got, dim=0) > 0.999
    assert any("0.qkv" in ln and "'groups': 2" in ln for ln in lines)  # the layer's own groups
    assert any("0.fc1" in ln and "'groups': 4" in ln for ln in lines)  # the model's grouping
    ts.remove(model)
    assert ts.handle_of(model) is None


def test_layers_compute_what_torch_computes() -> None:
    x = torch.randn(4, 8)
    assert torch.equal(ms.GELU(quant_groups=2)(x), nn.GELU()(x))
    assert torch.equal(ms.MatMul()(x, x.t()), x @ x.t())
    assert torch.equal(ms.Softmax(dim=-1, quant_groups=3)(x), x.softmax(-1))
    with pytest.raises(ValueError, match="quant_groups"):
        ms.ReLU(quant_groups=0)
    with pytest.raises(ValueError, match="num_groups"):
        ms.policy.convert_by_num_groups(nn.Linear(2, 2), 0)


def test_group_size_grouping() -> None:
    q = ms.MesaQuantizer(group_size=16)
    packed = q.compress(torch.randn(4, 10, 64), ts.Site(module="m", op="linear", role="input"))
    lo = packed.tensors["lo"]
    assert isinstance(lo, torch.Tensor) and lo.numel() == 4  # 64 channels / 16
