"""Absorbed MLA decode attention for static (CUDA-graph) decode steps.

`mla_decode_attention` computes, per sequence, the softmax-weighted cached latents over positions
0 .. context_lens[b] of its slot. The reference (`ref.py`, fp32) gathers the attention window and masks it;
the Triton kernel (`triton.py`) reads only each sequence's real positions from the cache (split-context,
flash-decoding style), with no window copies.

On CUDA the kernel is the default (checked against the reference on an H200 and 4-14x faster than it at K3's
widths, bench/RESULTS.md); K3RUN_MLA_DECODE_KERNEL=0 selects the reference instead. For static steps
of up to K3RUN_MLA_ABSORB_KERNELS sequences (default 64), `mla_latent_store` normalises, joins and stores
the step's latents in one launch, and `mla_decode_absorbed` also does the query absorption (q_nope . W_UK)
and the output projection (. W_UV) in one launch each: one sequence at a time up to 8, from 9 on the tensor
cores with the fp32 factors split exactly into bf16 parts (kernels/tc_split.py).
"""

from __future__ import annotations

import torch

from k3run.knobs import knobs

from .ref import mla_decode_ref, mla_latent_store_ref, mla_o_absorb_ref, mla_q_absorb_ref


def decode_kernel_enabled(device: torch.device) -> bool:
    return device.type == "cuda" and knobs().mla_decode_kernel


def absorb_kernels_enabled(device: torch.device, batch: int) -> bool:
    """The absorb kernels for a static step of `batch` sequences: up to K3RUN_MLA_ABSORB_KERNELS of them (from
    9 sequences in their tensor-core forms, `triton.absorb_dot`; above the knob, torch's chain)."""
    return device.type == "cuda" and batch <= knobs().mla_absorb_kernels


def mla_latent_store(
    kv_a: torch.Tensor, weight: torch.Tensor, eps: float, store: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor,
) -> None:  # fmt: skip
    """Normalise, join and store each row's latent in the cache in one launch on CUDA (the reference:
    mla_latent_store_ref); a static step calls it where `absorb_kernels_enabled`."""
    from .triton import mla_latent_store_triton

    mla_latent_store_triton(kv_a, weight, eps, store, slots, positions)


def mla_decode_absorbed(
    q: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    store: torch.Tensor,
    slots: torch.Tensor,
    context_lens: torch.Tensor,
    window: int,
    scale: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The whole absorbed decode attention of a static step on CUDA in four launches: the queries absorbed
    and joined (`mla_q_absorb_triton`), the split kernel and its merge, the output out of latent space
    rounded to out_dtype (`mla_o_absorb_triton`). q [B, H, d_n + R] -> [B, H, d_v]; the reference is
    mla_o_absorb_ref(mla_decode_ref(*split(mla_q_absorb_ref(q, w_uk))), w_uv, out_dtype)."""
    from .triton import mla_decode_joined_triton, mla_o_absorb_triton, mla_q_absorb_triton

    L = w_uk.shape[2]
    # 16-bit caches: the queries written in the cache's dtype, which the decode kernel rounds them to anyway
    half = store.dtype in (torch.bfloat16, torch.float16)
    joined = mla_q_absorb_triton(q, w_uk, out_dtype=store.dtype if half else torch.float32)
    o_lat = mla_decode_joined_triton(joined, L, store, slots, context_lens, window, scale)
    return mla_o_absorb_triton(o_lat, w_uv, out_dtype)


def mla_decode_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    store: torch.Tensor,
    slots: torch.Tensor,
    context_lens: torch.Tensor,
    window: int,
    scale: float,
) -> torch.Tensor:
    """o_lat [B, H, L] fp32; see mla_decode_ref for the contract."""
    if decode_kernel_enabled(q_lat.device):
        from .triton import mla_decode_triton

        return mla_decode_triton(q_lat, q_pe, store, slots, context_lens, window, scale)
    return mla_decode_ref(q_lat, q_pe, store, slots, context_lens, window, scale)


__all__ = [
    "absorb_kernels_enabled", "decode_kernel_enabled", "mla_decode_absorbed", "mla_decode_attention",
    "mla_decode_ref", "mla_latent_store", "mla_latent_store_ref", "mla_o_absorb_ref", "mla_q_absorb_ref",
]  # fmt: skip
