"""Models of the PyTorch experiments, written by hand (no torchvision here).

* ``gpt2``: a GPT-2-small-shaped decoder (12 layers, 12 heads, d=768, vocabulary 50257, context
  1024, output head tied to the token embedding): 124.4 M parameters; with AdamW's two moments
  ~1.5 GB of state. Short sequences (``SEQ`` tokens) keep a CPU step short.
* ``resnet50``: ResNet-50's shape (bottleneck blocks 3-4-6-3, widths 64..2048, BatchNorm, 1000
  classes): 25.6 M parameters, 161 parameter tensors and 106 BatchNorm buffers; 32x32 inputs.
* ``mlp``: 500 ``Linear(32, 32)`` layers: 1000 small parameter tensors (528 K parameters), for
  the per-tensor costs.

``batch(name, step, rank)`` gives a deterministic input batch and target.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

SEQ = 32


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, vocab: int = 50257, ctx: int = 1024, d: int = 768, layers: int = 12, heads: int = 12) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.h = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.h:
            x = blk(x)
        return self.lm_head(self.ln_f(x))


class _Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * 4
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64)
        layers, cin = [], 64
        for width, n, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(n):
                layers.append(_Bottleneck(cin, width, stride if i == 0 else 1))
                cin = width * 4
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(x), 1), 1))


class MLP(nn.Module):
    def __init__(self, layers: int = 500, width: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        for m in self.layers:
            nn.init.normal_(m.weight, std=1 / math.sqrt(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.layers:
            x = x + 0.1 * torch.tanh(m(x))
        return x


MODELS = {"gpt2": GPT2, "resnet50": ResNet50, "mlp": MLP}
BATCH = {"gpt2": 2, "resnet50": 4, "mlp": 64}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


def batch(name: str, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    n = BATCH[name]
    if name == "gpt2":
        idx = torch.randint(0, 50257, (n, SEQ + 1), generator=g)
        return idx[:, :-1], idx[:, 1:]
    if name == "resnet50":
        return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 1000, (n,), generator=g)
    return torch.randn(n, 32, generator=g), torch.randn(n, 32, generator=g)


def loss_of(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if name == "gpt2":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    if name == "resnet50":
        return F.cross_entropy(out, target)
    return F.mse_loss(out, target)
