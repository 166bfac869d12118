"""Routed-expert picks grouped by expert, on the device, for the expert-major NVFP4 decode launch.

`expert_groups(ids, n_experts, bt)` turns the picks of a decode batch (ids [P]: the local expert of each
(token, slot) pick, in token order; ids outside [0, n_experts) are other ranks' experts) into a table
grp [G, 1 + bt] int32:
- grp[g, 0]: the expert of group g, groups in increasing expert order; -1 for the unused groups at the end;
- grp[g, 1 + j]: the pick index of the group's j-th pick (picks in increasing order), -1 past its count.
An expert picked c times gets ceil(c / bt) groups: its first bt picks, the next bt, and so on. G =
`max_groups(P, n_experts, bt)` = H + (P - H) // bt with H = min(P, n_experts), the most groups any P picks
can need (at most H experts are hit, and the sum of ceil(c_e / bt) over them is largest when H are), so the
table's shape depends only on (P, n_experts, bt). One program, no host synchronisation, so a CUDA graph can
hold it. `expert_groups_ref` is the torch reference.
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
        n_grp = (cnt + BT - 1) // BT  # groups of each expert (0 if not picked)
        first = carry + tl.cumsum(n_grp, axis=0) - n_grp  # each expert's first group
        rank = tl.cumsum(eq.to(tl.int32), axis=1) - 1  # the pick's place among its expert's picks
        row = grp_ptr + (first[:, None] + rank // BT) * (BT + 1)
        tl.store(row + 1 + rank % BT, tl.broadcast_to(p[None, :], eq.shape), mask=eq)
        ex = tl.broadcast_to(e[:, None], eq.shape)
        tl.store(row, ex, mask=eq & (rank % BT == 0))  # the first pick of each group names its expert
        carry += tl.sum(n_grp, axis=0)


def max_groups(picks: int, n_experts: int, bt: int) -> int:
    """Rows of expert_groups' table: the most groups of at most bt picks that `picks` picks over `n_experts`
    experts can need (module docstring)."""
    hit = min(picks, n_experts)
    return max(1, hit + (picks - hit) // bt)


def expert_groups(ids: torch.Tensor, n_experts: int, bt: int) -> torch.Tensor:
    """The group table grp [max_groups(P, n_experts, bt), 1 + bt] int32 of the picks ids [P] (module
    docstring)."""
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert_groups: ids must be int32/int64 [P], got {ids.dtype} {tuple(ids.shape)}")
    if bt < 1 or n_experts < 1:
        raise ValueError(f"expert_groups: bt={bt}, n_experts={n_experts}; both must be >= 1")
    picks = ids.shape[0]
    groups = max_groups(picks, n_experts, bt)
    grp = torch.empty(groups, bt + 1, dtype=torch.int32, device=ids.device)
    if picks == 0:
        return grp.fill_(-1)
    block_p = triton.next_power_of_2(picks)
    block_e = max(1, min(triton.next_power_of_2(n_experts), max(16, 8192 // block_p)))
    _expert_groups_kernel[(1,)](
        ids, grp, picks, n_experts, groups, BT=bt, BLOCK_P=block_p, BLOCK_E=block_e, BLOCK_G=64,
        BLOCK_C=triton.next_power_of_2(bt + 1), num_warps=4 if block_p <= 512 else 8,
    )  # fmt: skip
    return grp


def expert_groups_ref(ids: torch.Tensor, n_experts: int, bt: int) -> torch.Tensor:
    """expert_groups in torch (host loop; for tests)."""
    picks = ids.shape[0]
    grp = torch.full((max_groups(picks, n_experts, bt), bt + 1), -1, dtype=torch.int32)
    host, g = ids.cpu(), 0
    for e in range(n_experts):
        where = (host == e).nonzero().flatten().tolist()
        for c in range(0, len(where), bt):
            grp[g, 0] = e
            for j, s in enumerate(where[c : c + bt]):
                grp[g, 1 + j] = s
            g += 1
    return grp.to(ids.device)
