"""SigLIP vision tower (So400m/14 at full size) and PaliGemma's linear projector.

Module names mirror Hugging Face's SiglipVisionModel so openpi checkpoints load without renaming.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import SiglipConfig


def sincos_positions(grid: int, width: int) -> Tensor:
    """Fixed 2-D sin-cos position embeddings [grid * grid, width] for a row-major patch grid (as
    MAE's from-scratch ViTs use): a quarter of the channels each for sin and cos of the column,
    then of the row, at frequencies 10000^(-i / (width / 4))."""
    if width % 4:
        raise ValueError(f"sin-cos positions need a width divisible by 4, got {width}")
    quarter = width // 4
    omega = 1.0 / (10000 ** (torch.arange(quarter, dtype=torch.float32) / quarter))
    rows, cols = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")

    def embed(t: Tensor) -> Tensor:
        angles = t.reshape(-1, 1).float() * omega[None]
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    return torch.cat([embed(cols), embed(rows)], dim=1)


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            3, cfg.width, kernel_size=cfg.patch_size, stride=cfg.patch_size
        )
        self.position_embedding = nn.Embedding(cfg.num_patches, cfg.width)

    def forward(self, pixels: Tensor) -> Tensor:
        # [B, W, 16, 16]
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight[None]


class SiglipAttention(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.width // cfg.num_heads
        self.q_proj = nn.Linear(cfg.width, cfg.width)
        self.k_proj = nn.Linear(cfg.width, cfg.width)
        self.v_proj = nn.Linear(cfg.width, cfg.width)
        self.out_proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: Tensor) -> Tensor:
        b, n, w = x.shape

        def heads(t: Tensor) -> Tensor:
            return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

        scores = (
            heads(self.q_proj(x)) @ heads(self.k_proj(x)).transpose(-1, -2) * self.head_dim**-0.5
        )
        probs = scores.float().softmax(dim=-1).to(x.dtype)
        out = (probs @ heads(self.v_proj(x))).transpose(1, 2).reshape(b, n, w)
        return self.out_proj(out)


class SiglipMLP(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.width, cfg.mlp_dim)
        self.fc2 = nn.Linear(cfg.mlp_dim, cfg.width)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipEncoderLayer(nn.Module):
    """Pre-LN transformer block."""

    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.width, eps=1e-6)
        self.self_attn = SiglipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.width, eps=1e-6)
        self.mlp = SiglipMLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(cfg) for _ in range(cfg.depth))


class SiglipVisionTransformer(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = SiglipEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.width, eps=1e-6)

    def forward(self, pixels: Tensor) -> Tensor:
        x = self.embeddings(pixels)
        x = x.to(self.post_layernorm.weight.dtype)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class SiglipVisionTower(nn.Module):
    """Wrapper that reproduces the ``vision_tower.vision_model`` key prefix."""

    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.vision_model = SiglipVisionTransformer(cfg)

    def forward(self, pixels: Tensor) -> Tensor:
        return self.vision_model(pixels)


class MultiModalProjector(nn.Module):
    def __init__(self, vision_width: int, text_width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(vision_width, text_width)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x)
