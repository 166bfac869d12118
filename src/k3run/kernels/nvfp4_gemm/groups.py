"""Routed-expert picks grouped by expert, on the device, for the expert-major NVFP4 decode launch.

`expert_groups(ids, n_experts, bt)` turns the picks of a decode batch (ids [P]: the local expert of each
(token, slot) pick, in token order; ids outside [0, n_experts) are other ranks' experts) into a table
grp [G, 1 + bt] int32:
- grp[g, 0]: the expert of group g, groups in increasing expert order; -1 for the unused groups at the end;
- grp[g, 1 + j]: the pick index of the group's j-th pick (picks in increasing order), -1 past its count.
An expert picked c times gets ceil(c / bt) groups: its first bt picks, the next bt, and so on. G =
`max_groups(P, n_experts, bt)` = H + (P - H) // bt with H = min(P, n_experts), the most groups any P picks
can need (at most H experts are hit, and the sum of ceil(c_e / bt) over them is largest when H are), so the
table's shape depends only on (P, n_experts, bt). One program (no host synchronisation, so a CUDA graph can
hold it) with O(P + E) scratch; no [P, E] intermediate. Two forms (`K3RUN_MOE_GROUPS`):
- atomic (the default, up to ATOMIC_MAX_PICKS picks): every pick's rank from one atomic add on its expert's
  counter, all picks at once, so the round trips do not grow with the picks (H100: 2.0 / 2.5 / 4.0 us at
  64 / 256 / 512 picks against 3.6 / 10.6 / 19.9 for the passes; bench/RESULTS.md). The ranks follow the
  order the atomics land in, so a group's picks (and, for an expert picked more than bt times, which picks
  share a group) may come in any order; the experts, the groups' counts and each expert's set of picks are
  the reference's. The expert-major launch computes every pick's row on its own (columns of one mma tile do
  not mix), so its outputs do not depend on that order.
- passes: picks in chunks of 64, each pick's rank among its expert's picks by pairwise compares, a few
  dependent L2 round trips a chunk; a group's picks in increasing order (the reference's table, bit for bit).
`expert_groups_ref` is the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3run.kernels.pdl import pdl_args, pdl_enter
from k3run.knobs import knobs

# the atomic form holds every pick in one program's registers: up to this many picks (K3 at 32 tokens: 512)
ATOMIC_MAX_PICKS = 1024


@triton.jit
def _load_picks(ids_ptr, p, P, E):
    """(expert as int32, whether it is one of this rank's) of picks p; a pick past P or outside [0, E) is a
    miss, tested in the ids' own dtype (an int64 id must not wrap into range when narrowed)."""
    e = tl.load(ids_ptr + p, mask=p < P, other=-1)
    hit = (p < P) & (e >= 0) & (e < E)
    return tl.where(hit, e, 0).to(tl.int32), hit


@triton.jit
def _fill_table(grp_ptr, cnt_ptr, E, G, BT: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
                BLOCK_C: tl.constexpr):  # fmt: skip
    """grp = -1 and cnt = 0 (both forms' first pass; the caller puts a barrier after it)."""
    gg = tl.arange(0, BLOCK_G)
    cc = tl.arange(0, BLOCK_C)  # the BT + 1 columns, padded to a power of two
    unset = tl.full([BLOCK_G, BLOCK_C], -1, tl.int32)
    for g0 in range(0, G, BLOCK_G):
        g = g0 + gg
        ok = (g < G)[:, None] & (cc < BT + 1)[None, :]
        tl.store(grp_ptr + g[:, None] * (BT + 1) + cc[None, :], unset, mask=ok)
    ee = tl.arange(0, BLOCK_E)
    for e0 in range(0, E, BLOCK_E):
        tl.store(cnt_ptr + e0 + ee, tl.zeros([BLOCK_E], tl.int32), mask=e0 + ee < E)


@triton.jit
def _first_groups(cnt_ptr, first_ptr, E, BT: tl.constexpr, BLOCK_E: tl.constexpr):
    """first[e] = the exclusive scan of ceil(cnt / BT) over the experts (the caller puts a barrier each side).
    cnt is read past L1 (.cg): the atomic form's counts were last written by atomics, which L1 never sees."""
    ee = tl.arange(0, BLOCK_E)
    carry = 0
    for e0 in range(0, E, BLOCK_E):
        m = e0 + ee < E
        n_grp = (tl.load(cnt_ptr + e0 + ee, mask=m, other=0, cache_modifier=".cg") + BT - 1) // BT
        tl.store(first_ptr + e0 + ee, carry + tl.cumsum(n_grp, axis=0) - n_grp, mask=m)
        carry += tl.sum(n_grp, axis=0)


@triton.jit
def _place_picks(grp_ptr, first_ptr, p, e, hit, rank, BT: tl.constexpr):
    """Picks p (of experts e, where hit) at their ranks among their experts' picks into the table: group
    first[e] + rank // BT, column 1 + rank % BT; the group's first place names its expert. first is read past
    L1 (.cg), as `_first_groups` wrote it just before."""
    row = grp_ptr + (tl.load(first_ptr + e, mask=hit, other=0, cache_modifier=".cg") + rank // BT) * (BT + 1)
    tl.store(row + 1 + rank % BT, p, mask=hit)
    tl.store(row, e, mask=hit & (rank % BT == 0))


@triton.jit
def _expert_groups_kernel(
    ids_ptr, grp_ptr, cnt_ptr, first_ptr, rank_ptr, P, E, G, BT: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(PDL)
    # One program, four passes over scratch cnt [E], first [E], rank [P] (barriers between them):
    # 1. grp = -1, cnt = 0; 2. picks in chunks of BLOCK_P, in order: a pick's rank among its expert's picks =
    # the expert's count before the chunk + its earlier picks in the chunk (a pairwise compare), and the
    # expert's last pick in the chunk writes the new count (one writer per expert, no atomics); 3. each
    # expert's first group = the exclusive scan of ceil(cnt / BT) over the experts; 4. every pick's place.
    _fill_table(grp_ptr, cnt_ptr, E, G, BT, BLOCK_E, BLOCK_G, BLOCK_C)
    tl.debug_barrier()
    pp = tl.arange(0, BLOCK_P)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + pp
        e, hit = _load_picks(ids_ptr, p, P, E)
        eq = (e[:, None] == e[None, :]) & hit[:, None] & hit[None, :]  # [pick, other pick of the chunk]
        before = tl.sum((eq & (pp[None, :] < pp[:, None])).to(tl.int32), axis=1)
        after = tl.sum((eq & (pp[None, :] > pp[:, None])).to(tl.int32), axis=1)
        base = tl.load(cnt_ptr + e, mask=hit, other=0)
        tl.store(rank_ptr + p, base + before, mask=hit)
        tl.debug_barrier()  # every base read before any count of this chunk is written
        tl.store(cnt_ptr + e, base + before + 1, mask=hit & (after == 0))
        tl.debug_barrier()
    _first_groups(cnt_ptr, first_ptr, E, BT, BLOCK_E)
    tl.debug_barrier()
    for p0 in range(0, P, BLOCK_P):
        p = p0 + pp
        e, hit = _load_picks(ids_ptr, p, P, E)
        _place_picks(grp_ptr, first_ptr, p, e, hit, tl.load(rank_ptr + p, mask=hit, other=0), BT)


@triton.jit
def _expert_groups_atomic_kernel(
    ids_ptr, grp_ptr, cnt_ptr, first_ptr, P, E, G, BT: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(PDL)
    # One program, three barriers: 1. grp = -1, cnt = 0; 2. every pick (P <= BLOCK_P) takes its rank among
    # its expert's picks by an atomic add on the expert's counter; 3. each expert's first group = the
    # exclusive scan of ceil(cnt / BT); 4. every pick's place (its rank stays in registers).
    _fill_table(grp_ptr, cnt_ptr, E, G, BT, BLOCK_E, BLOCK_G, BLOCK_C)
    tl.debug_barrier()
    p = tl.arange(0, BLOCK_P)
    e, hit = _load_picks(ids_ptr, p, P, E)
    rank = tl.atomic_add(cnt_ptr + e, tl.full([BLOCK_P], 1, tl.int32), mask=hit, sem="relaxed", scope="cta")
    tl.debug_barrier()
    _first_groups(cnt_ptr, first_ptr, E, BT, BLOCK_E)
    tl.debug_barrier()
    _place_picks(grp_ptr, first_ptr, p, e, hit, rank, BT)


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
    scratch = torch.empty(2 * n_experts + picks, dtype=torch.int32, device=ids.device)
    block_e = min(1024, triton.next_power_of_2(n_experts))
    if picks <= ATOMIC_MAX_PICKS and knobs().moe_groups == "atomic":
        _expert_groups_atomic_kernel[(1,)](
            ids, grp, scratch, scratch[n_experts:], picks, n_experts, groups, BT=bt,
            BLOCK_P=max(32, triton.next_power_of_2(picks)), BLOCK_E=block_e, BLOCK_G=64,
            BLOCK_C=triton.next_power_of_2(bt + 1), num_warps=4, **pdl_args(ids),
        )  # fmt: skip
        return grp
    _expert_groups_kernel[(1,)](
        ids, grp, scratch, scratch[n_experts:], scratch[2 * n_experts :], picks, n_experts, groups, BT=bt,
        BLOCK_P=64, BLOCK_E=block_e, BLOCK_G=64,
        BLOCK_C=triton.next_power_of_2(bt + 1), num_warps=4, **pdl_args(ids),
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


def same_groups(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether table `got` is the reference table `want` up to the order of each expert's picks over its
    groups (what the atomic form leaves open): the same shape, the same expert in every row, the same count
    of picks in every row and as a prefix of its columns (-1 after), and each expert's picks the same set."""
    got, want = got.cpu(), want.cpu()
    if got.shape != want.shape or not torch.equal(got[:, 0], want[:, 0]):
        return False
    placed = got[:, 1:] >= 0
    if not torch.equal(placed, want[:, 1:] >= 0) or bool((got[:, 1:][~placed] != -1).any()):
        return False
    for e in want[:, 0].unique().tolist():
        rows = want[:, 0] == e
        mine, theirs = got[rows, 1:][placed[rows]], want[rows, 1:][placed[rows]]
        if e >= 0 and sorted(mine.tolist()) != sorted(theirs.tolist()):
            return False
    return True
