"""Gated activations on a non-interleaved [.., gate(d) | up(d)] input, fp32 math, one cast at the end."""

from __future__ import annotations

import torch

from k3run.kernels.moe_ops import gated


def _check_even(x: torch.Tensor) -> None:
    if x.shape[-1] % 2:
        raise ValueError(
            f"gated activation input: last dim must be even (gate|up), got shape {tuple(x.shape)}"
        )


def _split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check_even(x)
    d = x.shape[-1] // 2
    return x[..., :d].float(), x[..., d:].float()


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(g) * u for x = [g | u]; [.., 2d] -> [.., d] in x's dtype."""
    g, u = _split(x)
    return (torch.nn.functional.silu(g) * u).to(x.dtype)


def situ_and_mul(x: torch.Tensor, beta: float = 4.0, linear_beta: float | None = 25.0) -> torch.Tensor:
    """K3's SiTU: beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta); [.., 2d] -> [.., d].

    The tanh terms are soft caps (|gate part| < beta, |up part| < linear_beta); linear_beta None leaves u
    unchanged. beta -> inf recovers SwiGLU.
    """
    if beta <= 0:
        raise ValueError(f"situ_and_mul: beta must be > 0, got {beta}")
    g, u = _split(x)
    gate = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        if linear_beta <= 0:
            raise ValueError(f"situ_and_mul: linear_beta must be > 0 or None, got {linear_beta}")
        u = linear_beta * torch.tanh(u / linear_beta)
    return (gate * u).to(x.dtype)


class GatedActivation:
    """The activation a config names ("silu" or "situ"), callable on [.., 2d] gate|up tensors.

    Also used on already-split fp32 halves by the NVFP4 MoE, which must dequantize gate and up separately.
    """

    def __init__(self, kind: str, beta: float | None = None, linear_beta: float | None = None) -> None:
        if kind not in ("silu", "situ"):
            raise ValueError(f"hidden_act: expected 'silu' or 'situ', got {kind!r}")
        if kind == "situ" and beta is None:
            raise ValueError("hidden_act 'situ' needs activation_situ_beta")
        self.kind = kind
        self.beta = beta
        self.linear_beta = linear_beta

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dim() == 2:  # one launch (kernels/moe_ops) instead of five
            _check_even(x)
            return gated(x, self.kind, self.beta or 0.0, self.linear_beta, x.dtype)
        if self.kind == "silu":
            return silu_and_mul(x)
        return situ_and_mul(x, self.beta, self.linear_beta)  # type: ignore[arg-type]

    def on_halves(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """fp32 act(gate, up) for separately given halves (no dtype cast)."""
        return self(torch.cat([gate.float(), up.float()], dim=-1))

    def __repr__(self) -> str:
        if self.kind == "silu":
            return "GatedActivation(silu)"
        return f"GatedActivation(situ, beta={self.beta}, linear_beta={self.linear_beta})"
