"""KDA on CUDA through fla-core's Triton kernels (`chunk_kda` for prefill, `fused_recurrent_kda` for decode).

fla-core is an optional run-time dependency (the `gpu` extra). `fla_kda_ops()` imports it at most once per
process and answers None when it is missing, so the dispatcher in this package falls back to the fp32
reference with one log line instead of failing.

Layouts. Our varlen batches are flat [T, ...] tensors with cu_seqlens [B+1]; fla takes the same data as a
batch of one, [1, T, ...], with `cu_seqlens` (int64). Our recurrent states are [B, H, K, V] fp32, which is
fla's default layout (`state_v_first=False`; vLLM and the official K3 code use the transposed [B, H, V, K]),
so states are passed and returned without a copy.

Two entry styles:
- `*_fla_raw`: the call Moonshot's K3 modeling code makes: the raw forget-gate projection f
  with A_log / dt_bias, the raw beta logits and un-normalised q, k; the gate (softplus, or the lower-bound
  sigmoid), sigmoid(beta) and the q/k L2 norm all run inside the kernels.
- `*_fla`: inputs already activated (g log decay, beta post-sigmoid, q/k normalised), the contract of
  kernels.kda.chunk_kda / recurrent_kda.
Both return o [T, H, V] in fp32 (the reference's contract; fla writes it in the input dtype) and the final
states [B, H, K, V] fp32.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch

log = logging.getLogger(__name__)

# fla's "safe_gate" (the M=16 tensor-core path of chunk_kda) accepts lower bounds in [-5, 0) only; other
# bounds still get the lower-bound gate, on the general path.
SAFE_GATE_MIN = -5.0


@functools.cache
def fla_kda_ops() -> ModuleType | None:
    """fla.ops.kda, or None (logged once) when fla-core is not installed."""
    try:
        import fla.ops.kda as ops
    except ImportError as e:
        log.warning("fla-core is not importable (%s): KDA runs the slow fp32 torch reference on CUDA", e)
        return None
    return ops


def _ops() -> ModuleType:
    ops = fla_kda_ops()
    if ops is None:
        raise RuntimeError("kernels.kda.fla: fla-core is not installed (pip install 'k3run[gpu]')")
    return ops


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
) -> None:
    if q.dim() != 3:
        raise ValueError(f"kda (fla): q must be [T, H, K], got {tuple(q.shape)}")
    T, H, K = q.shape
    V = v.shape[-1]
    expected = {"k": (T, H, K), "v": (T, H, V), "g": (T, H, K), "beta": (T, H)}
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if tuple(t.shape) != expected[name]:
            raise ValueError(f"kda (fla): {name} must have shape {expected[name]}, got {tuple(t.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"kda (fla): cu_seqlens must be [B+1], got {tuple(cu_seqlens.shape)}")
    B = cu_seqlens.numel() - 1
    if initial_state is not None:
        if tuple(initial_state.shape) != (B, H, K, V):
            raise ValueError(
                f"kda (fla): initial_state must have shape {(B, H, K, V)}, got {tuple(initial_state.shape)}"
            )
        if initial_state.dtype != torch.float32:
            raise ValueError(f"kda (fla): initial_state must be float32, got {initial_state.dtype}")


def _batch1(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.unsqueeze(0) for t in ts]


def _run(
    decode: bool,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    gate: dict,
    cu_seqlens_cpu: torch.Tensor | None = None,
    graph: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    ops = _ops()
    T = q.shape[0]
    cu = cu_seqlens.to(device=q.device, dtype=torch.long)
    q1, k1, v1, g1, b1 = _batch1(q, k, v, g, beta)
    common = dict(
        scale=scale,
        initial_state=initial_state.contiguous() if initial_state is not None else None,
        output_final_state=True,
        state_v_first=False,
        cu_seqlens=cu,
        **gate,
    )
    if decode:
        o, final = ops.fused_recurrent_kda(q1, k1, v1, g1, b1, **common)
    elif graph:  # the chunk indices built on the device at their largest size: nothing read back
        o, final = ops.chunk_kda(q1, k1, v1, g1, b1, use_graph=True, max_num_seqs=cu.numel() - 1, **common)
    else:
        # with the host offsets, the chunk indices and the intra-card split need no device read-back
        o, final = ops.chunk_kda(q1, k1, v1, g1, b1, cu_seqlens_cpu=cu_seqlens_cpu, **common)
    return o.reshape(T, *o.shape[2:]).float(), final


def _gate_options(
    A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None, decode: bool
) -> dict:
    opts: dict = dict(
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        lower_bound=lower_bound,
        A_log=A_log.float().contiguous(),
        dt_bias=dt_bias.float().reshape(-1).contiguous(),
    )
    if not decode:
        opts["safe_gate"] = lower_bound is not None and SAFE_GATE_MIN <= lower_bound < 0
    return opts


def kda_fla_raw(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    f: torch.Tensor,
    b: torch.Tensor,
    *,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    scale: float,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    decode: bool,
    cu_seqlens_cpu: torch.Tensor | None = None,
    graph: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K3's fused call. q, k [T, H, K] un-normalised; v [T, H, V]; f [T, H, K] raw forget-gate projection;
    b [T, H] raw beta logits; A_log [H]; dt_bias [H*K]; decode picks fused_recurrent_kda over chunk_kda;
    graph: chunk_kda's graph mode (device-built chunk indices of a fixed size, for a CUDA-graph capture)."""
    _check(q, k, v, f, b, initial_state, cu_seqlens)
    H, K = q.shape[1:]
    if A_log.numel() != H or dt_bias.numel() != H * K:
        raise ValueError(
            f"kda (fla): A_log must have H={H} and dt_bias H*K={H * K} elements, "
            f"got {tuple(A_log.shape)} and {tuple(dt_bias.shape)}"
        )
    if lower_bound is not None and not lower_bound < 0:
        raise ValueError(f"kda (fla): lower_bound must be negative or None, got {lower_bound}")
    dtype = v.dtype
    return _run(
        decode,
        q.to(dtype),
        k.to(dtype),
        v,
        f,
        b,
        scale=scale,
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        gate=_gate_options(A_log, dt_bias, lower_bound, decode),
        cu_seqlens_cpu=cu_seqlens_cpu,
        graph=graph,
    )


def kda_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    decode: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-activated inputs (g fp32 log decay, beta post-sigmoid, q/k normalised), no in-kernel options.

    q and k (fp32 out of l2norm) are cast to v's dtype: fla's dots want one operand dtype, and its own
    in-kernel L2 norm also writes the normalised q, k in the input dtype.
    """
    _check(q, k, v, g, beta, initial_state, cu_seqlens)
    dtype = v.dtype
    return _run(
        decode,
        q.to(dtype),
        k.to(dtype),
        v,
        g.float(),
        beta.float(),
        scale=scale,
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        gate={},
    )


@functools.cache
def _fused_recurrent_fwd():
    """fla's `fused_recurrent_kda_fwd` when it can read and write states in a pool in place (the public
    `fused_recurrent_kda` always copies them out); None otherwise (logged once)."""
    import inspect

    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except ImportError:
        return None
    params = inspect.signature(fused_recurrent_kda_fwd).parameters
    if not {"ssm_state_indices", "inplace_final_state", "initial_state"} <= set(params):
        log.info("fla-core's fused_recurrent_kda_fwd has no in-place state pool: KDA decode gathers states")
        return None
    return fused_recurrent_kda_fwd


def kda_fla_raw_decode_in_place(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    f: torch.Tensor,
    b: torch.Tensor,
    *,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    scale: float,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> torch.Tensor | None:
    """kda_fla_raw for one token per sequence, the states read from and written back to state_pool[slots]
    ([S, H, K, V] fp32) by the kernel itself. Returns o [B, H, V] fp32, or None when this fla-core cannot."""
    fwd = _fused_recurrent_fwd()
    if fwd is None:
        return None
    B, H, K = q.shape
    V = v.shape[-1]
    if state_pool.dim() != 4 or tuple(state_pool.shape[1:]) != (H, K, V) or not state_pool.is_contiguous():
        raise ValueError(
            f"kda (fla): state_pool must be a contiguous [S, {H}, {K}, {V}], got {tuple(state_pool.shape)}"
        )
    if state_pool.dtype != torch.float32:
        raise ValueError(f"kda (fla): state_pool must be float32, got {state_pool.dtype}")
    if slots.shape != (B,):
        raise ValueError(f"kda (fla): slots must be [{B}], got {tuple(slots.shape)}")
    dtype = v.dtype
    q1, k1, v1, g1, b1 = (t.contiguous() for t in _batch1(q.to(dtype), k.to(dtype), v, f, b))
    # o written in fp32 by the kernel (its accumulator, not rounded to v's dtype first), into a tensor the
    # kernel fills whole (fla's own default is a zero-filled one in v's dtype: two more launches)
    out = torch.empty(v1.shape, dtype=torch.float32, device=v.device)
    o, _ = fwd(
        q1, k1, v1, g1, b1, scale=scale, initial_state=state_pool, inplace_final_state=True,
        output_final_state=False, state_v_first=False, cu_seqlens=cu_seqlens.to(torch.long),
        ssm_state_indices=slots, out=out, **_gate_options(A_log, dt_bias, lower_bound, decode=True),
    )  # fmt: skip
    return o.reshape(B, H, V).float()  # a no-op unless this fla-core ignores `out`
