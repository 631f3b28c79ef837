"""A tiny built-in GDN + KDA language model (FLA layers), for the demo, docs and tests.

Random-initialised, a few thousand parameters: small enough for Triton's CPU interpreter.
Needs flash-linear-attention (``pip install laqat[fla]``).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_heads: int = 2
    head_dim: int = 8
    layers: tuple[str, ...] = ("gdn", "kda")  # one FLA layer per entry, in order
    use_short_conv: bool = True


class TinyBlock(nn.Module):
    def __init__(self, kind: str, cfg: TinyConfig, layer_idx: int):
        super().__init__()
        try:
            from fla.layers import GatedDeltaNet, KimiDeltaAttention
        except ImportError as e:  # pragma: no cover - exercised only without FLA
            raise ImportError("the tiny demo model needs flash-linear-attention: pip install 'laqat[fla]'") from e
        common = dict(hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                      use_short_conv=cfg.use_short_conv, layer_idx=layer_idx)
        if kind == "gdn":
            self.attn = GatedDeltaNet(expand_v=1, **common)
        elif kind == "kda":
            self.attn = KimiDeltaAttention(expand_v=1, **common)
        else:
            raise ValueError(f"TinyConfig.layers entries must be 'gdn' or 'kda', got {kind!r}")
        self.norm = nn.RMSNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(cfg.hidden_size, 2 * cfg.hidden_size), nn.SiLU(),
                                 nn.Linear(2 * cfg.hidden_size, cfg.hidden_size))
        self.mlp_norm = nn.RMSNorm(cfg.hidden_size)

    def forward(self, x):
        x = x + self.attn(self.norm(x))[0]
        return x + self.mlp(self.mlp_norm(x))


class TinyHybridLM(nn.Module):
    """Embedding -> [GDN or KDA block + MLP] x len(cfg.layers) -> RMSNorm -> LM head."""

    def __init__(self, cfg: TinyConfig = TinyConfig()):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TinyBlock(kind, cfg, i) for i, kind in enumerate(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden_size)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
