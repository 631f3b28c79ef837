"""Tiny models for the distributed tests: both frontends, each with a recurrence that reads a carried state.

Every model maps ``(x [B, T, D], states)`` to a scalar loss that is a mean over the batch, so the loss
(and, averaged over ranks, every gradient) of a batch split across data-parallel ranks equals the loss
of the whole batch in one process. ``states`` are the initial recurrent states of the layers that take
one ([B, H, K, V] each, the carried state of truncated backpropagation through time): state_fp8 rounds
an initial state when it is loaded, so the policy moves the loss even at a few tokens (with a zero
initial state it rounds nothing a loss of T <= 64 tokens reads).

- ``TorchGDNNet``: two GDN layers whose recurrence is a token loop written in torch (the torch
  frontend's graph matching).
- ``GatedTorchGDNNet``: the same layer reading a parameter between the recurrence's intra-chunk part and
  its chunk loop (an output gate computed there): DDPOptimizer, which starts a gradient bucket at a
  parameter read, can split that recurrence across two graphs.
- ``FlaNet``: FLA's ``fla.layers.GatedDeltaNet`` (zero initial state, short convolutions) followed by
  a KDA layer that calls FLA's ``chunk_kda`` with its gate in the kernel and a carried state (the FLA
  frontend's call substitution).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

HIDDEN, HEADS, HEAD_DIM = 16, 2, 4


def _loss(x: torch.Tensor, head: nn.Linear) -> torch.Tensor:
    return head(x).square().mean()


class TorchGDN(nn.Module):
    """A GDN layer whose recurrence is a token loop in plain torch."""

    def __init__(self):
        super().__init__()
        inner = HEADS * HEAD_DIM
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(HIDDEN, inner, bias=False) for _ in range(3))
        self.a_proj, self.b_proj = nn.Linear(HIDDEN, HEADS), nn.Linear(HIDDEN, HEADS)
        self.o_proj = nn.Linear(inner, HIDDEN, bias=False)

    def heads(self, x):
        B, T, _ = x.shape
        q = F.normalize(self.q_proj(x).view(B, T, HEADS, HEAD_DIM), dim=-1)
        k = F.normalize(self.k_proj(x).view(B, T, HEADS, HEAD_DIM), dim=-1)
        v = self.v_proj(x).view(B, T, HEADS, HEAD_DIM)
        return q, k, v, F.logsigmoid(self.a_proj(x)), self.b_proj(x).sigmoid()

    def forward(self, x, h0):
        q, k, v, g, beta = self.heads(x)
        S, outs = h0, []
        for t in range(x.shape[1]):
            S = S * g[:, t].exp()[..., None, None]
            u = (v[:, t] - (S * k[:, t, ..., None]).sum(-2)) * beta[:, t, :, None]
            S = S + k[:, t, ..., None] * u[..., None, :]
            outs.append((S * q[:, t, ..., None]).sum(-2) * HEAD_DIM ** -0.5)
        o = torch.stack(outs, 1)
        return x + self.o_proj(o.flatten(2))


class GatedTorchGDN(TorchGDN):
    """The chunked (WY) delta rule in torch, with an output gate projected between its intra-chunk solve
    and its chunk loop: a parameter read inside the recurrence's span of the graph."""

    def __init__(self, chunk: int = 3):
        super().__init__()
        self.chunk = chunk
        self.gate_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)

    def forward(self, x, h0):
        q, k, v, g, beta = self.heads(x)
        B, T, H, K = q.shape
        C, N = self.chunk, T // self.chunk
        q = q * K ** -0.5
        q, k, v = (t.reshape(B, N, C, H, -1).permute(0, 3, 1, 2, 4) for t in (q, k, v))  # [B, H, N, C, D]
        g, beta = (t.reshape(B, N, C, H).permute(0, 3, 1, 2) for t in (g, beta))  # [B, H, N, C]
        gc = g.cumsum(-1)
        decay = (gc[..., :, None] - gc[..., None, :]).tril().exp().tril()
        kb = k * beta[..., None]
        A = torch.eye(C) + (kb @ k.transpose(-1, -2) * decay).tril(-1)
        u = torch.linalg.solve_triangular(A, v * beta[..., None], upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(A, kb * gc.exp()[..., None], upper=False, unitriangular=True)
        qk = q @ k.transpose(-1, -2) * decay
        gate = self.gate_proj(x).sigmoid()  # the parameter read between the two halves
        S, o = h0, torch.zeros_like(v)
        for n in range(N):
            vn = u[:, :, n] - w[:, :, n] @ S
            o[:, :, n] = (q[:, :, n] * gc[:, :, n, :, None].exp()) @ S + qk[:, :, n] @ vn
            kd = k[:, :, n] * (gc[:, :, n, -1:] - gc[:, :, n]).exp()[..., None]
            S = S * gc[:, :, n, -1, None, None].exp() + kd.transpose(-1, -2) @ vn
        o = o.permute(0, 2, 3, 1, 4).reshape(B, T, H, -1)
        return x + self.o_proj((o * gate.view(B, T, H, -1)).flatten(2))


class TorchGDNNet(nn.Module):
    layer_class = TorchGDN
    state_layers = (0, 1)  # the layers that read a carried state, in order

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(self.layer_class() for _ in range(2))
        self.head = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, states):
        for layer, h0 in zip(self.layers, states):
            x = layer(x, h0)
        return _loss(x, self.head)


class GatedTorchGDNNet(TorchGDNNet):
    layer_class = GatedTorchGDN


class FlaKDA(nn.Module):
    """KDA through FLA's ``chunk_kda`` (looked up on ``fla.layers.kda`` at call time, where the test oracle
    ``naive_fla()`` swaps it for FLA's torch reference), gate and beta activation in the kernel."""

    def __init__(self):
        super().__init__()
        inner = HEADS * HEAD_DIM
        self.q_proj, self.k_proj, self.v_proj, self.f_proj = (nn.Linear(HIDDEN, inner, bias=False) for _ in range(4))
        self.b_proj = nn.Linear(HIDDEN, HEADS)
        self.A_log = nn.Parameter(torch.empty(HEADS).uniform_(1, 4).log())
        self.dt_bias = nn.Parameter(0.1 * torch.randn(inner))
        self.o_proj = nn.Linear(inner, HIDDEN, bias=False)

    def forward(self, x, h0):
        import fla.layers.kda as kda_layer

        B, T, _ = x.shape
        q, k, v, f = (p(x).view(B, T, HEADS, HEAD_DIM) for p in (self.q_proj, self.k_proj, self.v_proj, self.f_proj))
        o, _ = kda_layer.chunk_kda(q=q, k=k, v=v, g=f, beta=self.b_proj(x), A_log=self.A_log, dt_bias=self.dt_bias,
                                   initial_state=h0, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                   use_beta_sigmoid_in_kernel=True)
        return x + self.o_proj(o.flatten(2))


class FlaGDN(nn.Module):
    """FLA's ``GatedDeltaNet`` layer as it ships (short convolutions, gated output norm)."""

    def __init__(self):
        super().__init__()
        from fla.layers import GatedDeltaNet

        self.attn = GatedDeltaNet(hidden_size=HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM, expand_v=1, layer_idx=0)

    def forward(self, x):
        return x + self.attn(x)[0]


class FlaNet(nn.Module):
    state_layers = (1,)

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([FlaGDN(), FlaKDA()])
        self.head = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, states):
        x = self.layers[1](self.layers[0](x), states[0])
        return _loss(x, self.head)


class FlaBlocksNet(nn.Module):
    state_layers = ()

    def __init__(self):
        super().__init__()
        from fla.models import KDAConfig
        from fla.models.kda.modeling_kda import KDABlock

        config = KDAConfig(hidden_size=HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM, expand_v=1, intermediate_size=32,
                           num_hidden_layers=3)
        self.embed = nn.Linear(HIDDEN, HIDDEN)  # as an LM's embedding: every block's input requires grad
        self.layers = nn.ModuleList(KDABlock(config, layer_idx) for layer_idx in range(3))
        self.head = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, states):
        x = self.embed(x)
        for block in self.layers:
            x = block(x)[0]
        return _loss(x, self.head)


def make_batch(B: int, T: int, model: nn.Module, seed: int = 1):
    """Fresh random inputs and carried states (never zeros) for ``model``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, HIDDEN, generator=gen)
    states = tuple(torch.randn(B, HEADS, HEAD_DIM, HEAD_DIM, generator=gen) for _ in model.state_layers)
    return x, states
