"""fp32 torch reference of absorbed MLA decode attention over a window of each sequence's cached latents."""

from __future__ import annotations

import torch


def mla_decode_ref(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    store: torch.Tensor,
    slots: torch.Tensor,
    context_lens: torch.Tensor,
    window: int,
    scale: float,
) -> torch.Tensor:
    """q_lat [B, H, L] fp32 (the NoPE query absorbed into latent space), q_pe [B, H, R]; store [S, >= window,
    L + R] the latent cache; sequence b attends positions 0 .. context_lens[b] of slot slots[b] (its new
    latent already stored at context_lens[b] < window). Returns o_lat [B, H, L] fp32 (softmax-weighted
    latents, before W_UV)."""
    L = q_lat.shape[-1]
    # the window's rows indexed by (slot, position) on the cache itself: the same values as
    # store[:, :window][slots], without a sliced view whose layout differs when window == N (a compiled
    # step would compile that window as a path of its own)
    lat = store[slots[:, None], torch.arange(window, device=store.device)[None, :]].float()  # [B, W, L + R]
    c, k_pe = lat[..., :L], lat[..., L:]
    scores = torch.einsum("bhl,bsl->bhs", q_lat, c) + torch.einsum("bhr,bsr->bhs", q_pe, k_pe)
    visible = torch.arange(window, device=q_lat.device)[None, :] <= context_lens[:, None]  # [B, W]
    p = torch.softmax((scores * scale).masked_fill(~visible[:, None, :], float("-inf")), dim=-1)
    return torch.einsum("bhs,bsl->bhl", p, c)  # [B, H, L]


def mla_q_absorb_ref(q: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q [B, H, d_n + R] (the query: NoPE then RoPE part), w_uk [H, d_n, L] fp32 -> [B, H, L + R] fp32: the
    NoPE query absorbed into latent space (q_nope . W_UK per head), then the RoPE part, as the decode kernel
    takes its queries."""
    dn = w_uk.shape[1]
    qf = q.float()
    return torch.cat([torch.einsum("bhd,hdl->bhl", qf[..., :dn], w_uk), qf[..., dn:]], dim=-1)


def mla_o_absorb_ref(o_lat: torch.Tensor, w_uv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """o_lat [B, H, L] fp32, w_uv [H, d_v, L] fp32 -> [B, H, d_v] in out_dtype: the attention output out of
    latent space (o_lat . W_UV^T per head) in fp32, rounded once."""
    return torch.einsum("bhl,hvl->bhv", o_lat.float(), w_uv).to(out_dtype)


def mla_latent_store_ref(
    kv_a: torch.Tensor, weight: torch.Tensor, eps: float, store: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor,
) -> None:  # fmt: skip
    """Store each row's latent in the cache: kv_a [B, L + R] (L = weight's length), the first L columns
    RMS-normalised in fp32 (x / sqrt(mean(x^2) + eps) * weight) and rounded to kv_a's dtype, joined with the
    RoPE columns, written in the store's dtype at store[slots[b], positions[b]]."""
    L = weight.shape[0]
    x = kv_a[:, :L].float()
    c = (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(kv_a.dtype)
    store[slots, positions] = torch.cat([c, kv_a[:, L:]], dim=-1).to(store.dtype)
