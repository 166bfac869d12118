"""Triton kernels of kernels/norm: one program per row (token), the whole row in registers (D <= 16384)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3run.kernels.pdl import pdl_args, pdl_enter

MAX_D = 16384


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    g_ptr,
    r_ptr,
    s_ptr,
    out_ptr,
    R,
    D,
    eps,
    HAS_GATE: tl.constexpr,
    HAS_RES: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
    cw_ptr=None,
    add_ptr=None,
    A: tl.constexpr = 0,
    HAS_ADD: tl.constexpr = False,
    W_EARLY: tl.constexpr = False,
):
    # BLOCK_R rows per program (several for short rows such as o_norm's 128), the whole row in registers.
    # W_EARLY: the weight is a parameter no kernel writes, so it loads before the PDL wait (its DRAM round
    # trip overlaps the previous kernel's tail instead of following it)
    cols = tl.arange(0, BLOCK_D)
    if W_EARLY:
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    pdl_enter(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    offs = rows[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RES:  # s = x + residual rounded to x's dtype (as torch's add), stored, then normalised
        if A > 0:  # the residual is the routed experts' top-k sum, as moe_ops' combine kernel computes it
            acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
            for k in tl.static_range(A):
                wk = tl.load(cw_ptr + rows * A + k, mask=rows < R, other=0.0)
                yk = tl.load(r_ptr + (rows[:, None] * A + k) * D + cols[None, :], mask=mask, other=0.0)
                acc += wk[:, None] * yk.to(tl.float32)
            r = acc.to(s_ptr.dtype.element_ty)
            if HAS_ADD:  # the shared experts' output, added after the rounding
                a = tl.load(add_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                r = (r.to(tl.float32) + a).to(s_ptr.dtype.element_ty)
        else:
            r = tl.load(r_ptr + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + offs, x, mask=mask)
    x = x.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    if not W_EARLY:
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    y = x * r[:, None] * w[None, :]
    if HAS_GATE:
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = y * (1.0 / (1.0 + tl.exp(-g)))
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _warps(block: int) -> int:
    return max(1, min(16, block // 512))


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gate: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    combine: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """rms_norm_ref / add_rms_norm_ref in one launch (residual given: returns (y, x + residual)). With
    combine = (weights fp32 [T, A], add [T, D] or None), residual is the routed experts' per-pick output
    [T * A, D] and the residual added is their top-k sum as moe_ops' combine (slot order in fp32, rounded to
    x's dtype, plus add rounded again): the combine, the add and the norm in one launch. A weight that is an
    nn.Parameter (a module's, which no kernel writes) is read before the PDL wait; any other weight after
    it, as it may be the previous launch's output."""
    _check_inputs(x, weight, gate, residual, combine)
    d = x.shape[-1]
    a = 0 if combine is None else combine[0].shape[1]
    xc = x.contiguous()
    out = torch.empty_like(xc, dtype=out_dtype or x.dtype)
    rc = residual.contiguous() if residual is not None else xc
    s = torch.empty_like(xc) if residual is not None else xc
    rows = xc.numel() // d if d else 0
    if rows > 0:
        block = triton.next_power_of_2(d)
        block_r = max(1, 2048 // block)
        gc = gate.contiguous() if gate is not None else xc
        cw = combine[0].float().contiguous() if combine is not None else xc
        add = combine[1].contiguous() if combine is not None and combine[1] is not None else xc
        wc = weight.contiguous()  # the parameter itself when it is contiguous
        _rms_norm_kernel[(triton.cdiv(rows, block_r),)](
            xc, wc, gc, rc, s, out, rows, d, eps, HAS_GATE=gate is not None,
            HAS_RES=residual is not None, BLOCK_R=block_r, BLOCK_D=block, num_warps=_warps(block_r * block),
            cw_ptr=cw, add_ptr=add, A=a, HAS_ADD=combine is not None and combine[1] is not None,
            W_EARLY=isinstance(wc, torch.nn.Parameter), **pdl_args(xc),
        )  # fmt: skip
    return out if residual is None else (out, s)


def _check_inputs(
    x: torch.Tensor,
    weight: torch.Tensor,
    gate: torch.Tensor | None,
    residual: torch.Tensor | None,
    combine: tuple[torch.Tensor, torch.Tensor | None] | None,
) -> None:
    d = x.shape[-1]
    if weight.numel() != d:
        raise ValueError(f"rms_norm: weight has {weight.numel()} elements, x's last dim is {d}")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"rms_norm: gate {tuple(gate.shape)} must have x's shape {tuple(x.shape)}")
    if combine is not None:
        _check_combine(x, residual, combine)
    elif residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"rms_norm: residual {tuple(residual.shape)} {residual.dtype} must have x's shape and dtype "
            f"{tuple(x.shape)} {x.dtype}"
        )
    if d > MAX_D:
        raise ValueError(f"rms_norm: last dim {d} is over the kernel's {MAX_D}")


def _check_combine(
    x: torch.Tensor, y: torch.Tensor | None, combine: tuple[torch.Tensor, torch.Tensor | None]
) -> None:
    weights, add = combine
    if x.dim() != 2 or y is None or weights.dim() != 2 or weights.shape[0] != x.shape[0]:
        raise ValueError(
            f"rms_norm with a combine: x [T, D], per-pick y [T * A, D] and weights [T, A] expected, got x "
            f"{tuple(x.shape)}, y {None if y is None else tuple(y.shape)}, weights {tuple(weights.shape)}"
        )
    t, d = x.shape
    if tuple(y.shape) != (t * weights.shape[1], d) or y.dtype != x.dtype:
        raise ValueError(f"rms_norm with a combine: y must be {x.dtype} [{t * weights.shape[1]}, {d}], got "
                         f"{y.dtype} {tuple(y.shape)}")  # fmt: skip
    if add is not None and (add.shape != x.shape or add.dtype != x.dtype):
        raise ValueError(f"rms_norm with a combine: add must be {x.dtype} {tuple(x.shape)}, got {add.dtype} "
                         f"{tuple(add.shape)}")  # fmt: skip


@triton.jit
def _attn_res_mix_kernel(
    v_ptr,
    q_ptr,
    out_ptr,
    N,
    T,
    D,
    eps,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    n_idx = tl.arange(0, BLOCK_N)
    scores = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    for n in range(N):
        v = tl.load(v_ptr + (n * T + t) * D + offs, mask=mask, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / D + eps)
        s = tl.sum(v * q, axis=0) * r
        scores = tl.where(n_idx == n, s, scores)
    p = tl.exp(scores - tl.max(scores, axis=0))
    p = p / tl.sum(p, axis=0)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for n in range(N):
        pn = tl.sum(tl.where(n_idx == n, p, 0.0), axis=0)
        v = tl.load(v_ptr + (n * T + t) * D + offs, mask=mask, other=0.0).to(tl.float32)
        acc += pn * v
    tl.store(out_ptr + t * D + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def attn_res_mix_triton(cands: list[torch.Tensor], query: torch.Tensor, eps: float) -> torch.Tensor:
    if not cands:
        raise ValueError("attn_res_mix: needs at least one candidate")
    t, d = cands[0].shape
    if d > MAX_D:
        raise ValueError(f"attn_res_mix: hidden size {d} is over the kernel's {MAX_D}")
    if query.numel() != d:
        raise ValueError(f"attn_res_mix: query has {query.numel()} elements, the candidates {d}")
    v = torch.stack(cands)  # [n, T, D] in the activation dtype: one copy launch
    out = torch.empty_like(cands[0])
    if t == 0:
        return out
    n = v.shape[0]
    block = triton.next_power_of_2(d)
    _attn_res_mix_kernel[(t,)](
        v, query.float().contiguous(), out, n, t, d, eps, BLOCK_N=triton.next_power_of_2(n), BLOCK_D=block,
        num_warps=_warps(block), **pdl_args(v),
    )  # fmt: skip
    return out
