"""Recurrent-state housekeeping for in-place KDA decode: zero the states of the sequences that start fresh.

A decode step that reads and writes the recurrent states in the cache pool in place (fla's
`fused_recurrent_kda_fwd` with `ssm_state_indices`) must first give every sequence with context length 0 a
zero state, because a slot may still hold a previous owner's. `zero_fresh_states_triton` does it on the
device without a host read of the context lengths (so a CUDA graph can hold it) and without touching the
other rows' states: one program per (row, block of the state); programs of rows that are not fresh return
after one load. `zero_fresh_states_ref` is the torch oracle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _check(pool: torch.Tensor, slots: torch.Tensor, context_lens: torch.Tensor) -> None:
    if pool.dim() < 2 or not pool[0].is_contiguous():
        raise ValueError(
            f"zero_fresh_states: pool must be [S, ...] with contiguous rows, got {tuple(pool.shape)}"
        )
    if slots.dim() != 1 or context_lens.shape != slots.shape:
        raise ValueError(
            f"zero_fresh_states: slots and context_lens must both be [B], got {tuple(slots.shape)} and "
            f"{tuple(context_lens.shape)}"
        )


def zero_fresh_states_ref(pool: torch.Tensor, slots: torch.Tensor, context_lens: torch.Tensor) -> None:
    """pool[slots[b]] = 0 for every b with context_lens[b] == 0 (in place)."""
    _check(pool, slots, context_lens)
    fresh = slots[context_lens == 0]
    if fresh.numel():
        pool[fresh] = 0


@triton.jit
def _zero_fresh_kernel(pool_ptr, slots_ptr, ctx_ptr, row_stride, row_elems, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    blk = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    if ctx == 0:
        slot = tl.load(slots_ptr + b).to(tl.int64)
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        zero = tl.zeros([BLOCK], dtype=pool_ptr.dtype.element_ty)
        tl.store(pool_ptr + slot * row_stride + offs, zero, mask=offs < row_elems)


def zero_fresh_states_triton(
    pool: torch.Tensor, slots: torch.Tensor, context_lens: torch.Tensor, block: int = 4096
) -> None:
    """zero_fresh_states_ref on the device: no host synchronisation, no reads of the states."""
    _check(pool, slots, context_lens)
    b = slots.numel()
    if b == 0:
        return
    row = pool[0].numel()
    grid = (b, triton.cdiv(row, block))
    _zero_fresh_kernel[grid](pool, slots, context_lens, pool.stride(0), row, BLOCK=block)
