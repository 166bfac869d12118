"""Routed-expert picks grouped by expert, on the device, for the expert-major NVFP4 decode launch.

`expert_groups(ids, n_experts, bt)` turns the picks of a decode batch (ids [P]: the local expert of each
(token, slot) pick, in token order; ids outside [0, n_experts) are other ranks' experts) into a table
grp [G, 1 + bt] int32, G = min(P, n_experts):
- grp[g, 0]: the expert of group g, groups in increasing expert order; -1 for the unused groups at the end;
- grp[g, 1 + j]: the pick index of the group's j-th pick (picks in increasing order), -1 past its count.
Every expert that was picked gets one group, so each group holds at most `bt` picks only when no expert is
picked more than `bt` times: true when every token's picks are distinct experts (a top-k) and there are at
most `bt` tokens, which the caller checks (`nvfp4_gemv_by_expert`). One program, no host synchronisation,
so a CUDA graph can hold it. `expert_groups_ref` is the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _expert_groups_kernel(
    ids_ptr, grp_ptr, P, E, G, BT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    p = tl.arange(0, BLOCK_P)
    pm = p < P
    ids = tl.load(ids_ptr + p, mask=pm, other=-1).to(tl.int32)
    gg = tl.arange(0, BLOCK_G)
    cc = tl.arange(0, BLOCK_C)  # the BT + 1 columns, padded to a power of two
    unset = tl.full([BLOCK_G, BLOCK_C], -1, tl.int32)
    for g0 in range(0, G, BLOCK_G):  # every entry -1 first
        g = g0 + gg
        ok = (g < G)[:, None] & (cc < BT + 1)[None, :]
        tl.store(grp_ptr + g[:, None] * (BT + 1) + cc[None, :], unset, mask=ok)
    tl.debug_barrier()
    carry = 0
    ee = tl.arange(0, BLOCK_E)
    for e0 in range(0, E, BLOCK_E):
        e = e0 + ee
        eq = (ids[None, :] == e[:, None]) & pm[None, :] & (e < E)[:, None]  # [BLOCK_E, BLOCK_P]
        cnt = tl.sum(eq.to(tl.int32), axis=1)
        hit = cnt > 0
        g = carry + tl.cumsum(hit.to(tl.int32), axis=0) - 1  # the group of each expert that was picked
        tl.store(grp_ptr + g * (BT + 1), e, mask=hit)
        rank = tl.cumsum(eq.to(tl.int32), axis=1) - 1  # the pick's place within its expert's group
        dest = grp_ptr + g[:, None] * (BT + 1) + 1 + rank
        tl.store(dest, tl.broadcast_to(p[None, :], eq.shape), mask=eq & (rank < BT))
        carry += tl.sum(hit.to(tl.int32), axis=0)


def expert_groups(ids: torch.Tensor, n_experts: int, bt: int) -> torch.Tensor:
    """The group table grp [min(P, n_experts), 1 + bt] int32 of the picks ids [P] (module docstring)."""
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert_groups: ids must be int32/int64 [P], got {ids.dtype} {tuple(ids.shape)}")
    picks = ids.shape[0]
    groups = max(1, min(picks, n_experts))
    grp = torch.empty(groups, bt + 1, dtype=torch.int32, device=ids.device)
    if picks == 0:
        return grp.fill_(-1)
    block_p = triton.next_power_of_2(picks)
    block_e = max(1, min(triton.next_power_of_2(n_experts), max(16, 8192 // block_p)))
    _expert_groups_kernel[(1,)](
        ids, grp, picks, n_experts, groups, BT=bt, BLOCK_P=block_p, BLOCK_E=block_e, BLOCK_G=64,
        BLOCK_C=triton.next_power_of_2(bt + 1), num_warps=4,
    )  # fmt: skip
    return grp


def expert_groups_ref(ids: torch.Tensor, n_experts: int, bt: int) -> torch.Tensor:
    """expert_groups in torch (host loop; for tests)."""
    picks = ids.shape[0]
    groups = max(1, min(picks, n_experts))
    grp = torch.full((groups, bt + 1), -1, dtype=torch.int32)
    host, g = ids.cpu(), 0
    for e in range(n_experts):
        where = (host == e).nonzero().flatten().tolist()
        if where:
            grp[g, 0] = e
            for j, s in enumerate(where[:bt]):
                grp[g, 1 + j] = s
            g += 1
    return grp.to(ids.device)
