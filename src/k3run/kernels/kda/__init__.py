"""Kimi Delta Attention ops: gate, q/k L2 norm, chunked prefill, recurrent decode and the short conv.

`_backend` is the one dispatch point: CPU tensors run the fp32 torch oracle (ref.py); CUDA tensors run
fla-core's Triton kernels (fla.py) when fla-core is installed, and the reference otherwise (logged once).

Two levels of entry:
- `kda_forward` takes the raw layer tensors (un-normalised q, k; the raw forget-gate projection f with A_log
  and dt_bias; the raw beta logits). On CPU it computes l2norm, kda_gate and sigmoid(beta) here and runs the
  reference; on CUDA it hands the raw tensors to fla with the gate, beta sigmoid and q/k norm fused in the
  kernels, the way the official K3 code calls chunk_kda / fused_recurrent_kda.
- `chunk_kda` / `recurrent_kda` take the activated inputs (g, post-sigmoid beta, normalised q, k).
The causal conv runs one Triton launch for prefill on CUDA (conv.py) and the reference elsewhere; decode steps
with a cache run `causal_conv1d_decode_in_place` and `kda_decode_in_place`, which keep the conv and recurrent
states in the cache pool (one Triton launch for the conv and fla's in-place recurrence on CUDA), or, up to
K3RUN_KDA_FUSED_DECODE sequences on CUDA (the layer's default), `kda_decode_fused`: the conv, the recurrence
and the gated output norm in one launch (decode.py).
"""

from __future__ import annotations

import torch

from k3run.kernels.kda.ref import (
    CHUNK_SIZE,
    L2NORM_EPS,
    _check_kda_inputs,
    causal_conv1d_decode_ref,
    causal_conv1d_ref,
    check_conv_inputs,
    chunk_kda_ref,
    kda_decode_fused_ref,
    kda_gate,
    l2norm,
    recurrent_kda_ref,
)

__all__ = [
    "CHUNK_SIZE",
    "L2NORM_EPS",
    "causal_conv1d",
    "causal_conv1d_decode",
    "causal_conv1d_decode_in_place",
    "causal_conv1d_planar",
    "chunk_kda",
    "kda_backend",
    "kda_decode_fused",
    "kda_decode_in_place",
    "kda_forward",
    "kda_gate",
    "l2norm",
    "recurrent_kda",
]


def _backend(x: torch.Tensor) -> str:
    """Which implementation runs for inputs living where `x` lives: "fla" or "ref"."""
    if not x.is_cuda:
        return "ref"
    from k3run.kernels.kda.fla import fla_kda_ops

    return "fla" if fla_kda_ops() is not None else "ref"


def kda_backend(device: str | torch.device) -> str:
    """The KDA implementation for tensors on `device` (for start-up reports and benchmarks)."""
    return _backend(torch.empty(0, device=device))


def kda_forward(
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
    """KDA from the raw layer tensors, gate / beta / q-k norm included.

    q, k [T, H, K] (after the short conv, not normalised); v [T, H, V]; f [T, H, K] raw forget-gate
    projection; b [T, H] raw beta logits; A_log [H]; dt_bias [H*K]; lower_bound None (softplus gate) or < 0
    (K3's sigmoid gate); initial_state [B, H, K, V] fp32 or None; cu_seqlens [B+1]. decode=True runs the
    token-by-token recurrence (every sequence one token), else the chunked algorithm. cu_seqlens_cpu: the
    same offsets on the host, when the caller has them (fla's chunked path then reads no device tensor back).
    graph=True (a prefill a CUDA graph captures; cu_seqlens only on the device): fla's graph mode, whose chunk
    indices are built on the device at a fixed size.
    Returns o [T, H, V] fp32 and the final states [B, H, K, V] fp32.
    """
    if _backend(q) == "fla":
        from k3run.kernels.kda.fla import kda_fla_raw

        return kda_fla_raw(
            q,
            k,
            v,
            f,
            b,
            A_log=A_log,
            dt_bias=dt_bias,
            lower_bound=lower_bound,
            scale=scale,
            initial_state=initial_state,
            cu_seqlens=cu_seqlens,
            decode=decode,
            cu_seqlens_cpu=cu_seqlens_cpu,
            graph=graph,
        )
    qn, kn = l2norm(q), l2norm(k)  # [T, H, K] fp32
    g = kda_gate(f, A_log, dt_bias, lower_bound)  # [T, H, K] fp32
    beta = torch.sigmoid(b.float())  # [T, H]
    if decode:
        return recurrent_kda_ref(qn, kn, v, g, beta, scale, initial_state, cu_seqlens)
    return chunk_kda(qn, kn, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens)


def kda_decode_fused(
    qkv: torch.Tensor,
    b: torch.Tensor,
    f: torch.Tensor,
    gate: torch.Tensor,
    **kw,
) -> torch.Tensor:
    """A whole decode step of a KDA head after the projections: conv (windows in conv_pool), gates, q/k L2
    norm, the recurrent step (states in state_pool) and the gated output norm. One Triton launch on CUDA
    (kernels/kda/decode.py, whose docstring has the math and the arguments); the fp32 torch reference
    (`kda_decode_fused_ref`) elsewhere. Returns the normed output [B, P]; both pools are updated at slots."""
    if qkv.is_cuda:
        from k3run.kernels.kda.decode import kda_decode_fused_triton

        return kda_decode_fused_triton(qkv, b, f, gate, **kw)
    for launch_only in ("block_v", "num_warps", "flat_shift", "persist"):  # the Triton launch's form
        kw.pop(launch_only, None)
    return kda_decode_fused_ref(qkv, b, f, gate, **kw)


def zero_fresh_states(pool: torch.Tensor, slots: torch.Tensor, context_lens: torch.Tensor) -> None:
    """pool[slots[b]] = 0 where context_lens[b] == 0, in place: on CUDA a Triton kernel without host reads."""
    from k3run.kernels.kda.state import zero_fresh_states_ref, zero_fresh_states_triton

    (zero_fresh_states_triton if pool.is_cuda else zero_fresh_states_ref)(pool, slots, context_lens)


def kda_decode_in_place(
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
    context_lens: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    fresh_zeroed: bool = False,
) -> torch.Tensor:
    """kda_forward for one token per sequence with the recurrent states kept in the cache pool: sequence i
    starts from state_pool[slots[i]] (zero when context_lens[i] == 0) and its final state is written back
    there. state_pool [S, H, K, V] fp32; q, k, f [B, H, K]; v [B, H, V]; b [B, H]; cu_seqlens: arange(B + 1)
    int64 on q's device if the caller has it (the step's ForwardContext does), else made here. Returns o
    [B, H, V] fp32. fresh_zeroed: the fresh sequences' states are already zero in the pool (the conv launch
    zeroed them: `causal_conv1d_decode_in_place(zero_pool=...)`), so the fla path skips its zeroing launch.

    On CUDA with fla-core the kernel reads and writes the pool in place (no gather / scatter of the states:
    at K3's 96 heads a state is 6.3 MB per sequence); on x86 CPUs with the SIMD extension
    (cpu_simd.kda_decode_step) too; elsewhere, and inside a compiled step, the reference runs on gathered
    states.
    """
    if state_pool.dtype != torch.float32:
        raise ValueError(f"kda_decode_in_place: state_pool must be float32, got {state_pool.dtype}")
    n = q.shape[0]
    cu = torch.arange(n + 1, device=q.device) if cu_seqlens is None else cu_seqlens
    if cu.shape != (n + 1,):
        raise ValueError(f"kda_decode_in_place: cu_seqlens must be [{n + 1}], got {tuple(cu.shape)}")
    if _backend(q) == "fla":
        if not fresh_zeroed:
            zero_fresh_states(state_pool, slots, context_lens)
        from k3run.kernels.kda.fla import kda_fla_raw_decode_in_place

        o = kda_fla_raw_decode_in_place(
            q, k, v, f, b, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
            state_pool=state_pool, slots=slots, cu_seqlens=cu,
        )  # fmt: skip
        if o is not None:
            return o
    if not q.is_cuda and not torch.compiler.is_compiling() and state_pool.is_contiguous():
        from k3run.kernels import cpu_simd

        if cpu_simd.available():  # x86 CPUs: the states updated in place by the extension
            qn, kn = l2norm(q), l2norm(k)
            g = kda_gate(f, A_log, dt_bias, lower_bound)
            return cpu_simd.kda_decode_step(
                (qn * scale).contiguous(), kn.contiguous(), v.float().contiguous(), g.exp().contiguous(),
                torch.sigmoid(b.float()).contiguous(), state_pool, slots, context_lens,
            )  # fmt: skip
    # the reference on gathered states (fresh rows start from zero; the scatter below overwrites their slots)
    h0 = torch.where((context_lens != 0)[:, None, None, None], state_pool[slots], 0)
    o, final = kda_forward(
        q, k, v, f, b, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
        initial_state=h0, cu_seqlens=cu, decode=True,
    )  # fmt: skip
    state_pool[slots] = final
    return o


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen KDA for prefill: fla's chunked kernels on CUDA; on x86 CPUs with the SIMD extension the
    recurrence token by token in C++ (`cpu_simd.kda_prefill_recurrent`: on a 2-core AVX-512 box ~10x the
    chunked reference, whose many small torch ops dominate a CPU prefill); elsewhere the reference in
    CHUNK_SIZE chunks.

    q, k [T, H, K] L2-normalised; v [T, H, V]; g [T, H, K] fp32 log decay; beta [T, H] post-sigmoid;
    initial_state [B, H, K, V] fp32 or None; cu_seqlens [B+1]. Returns o [T, H, V] fp32 and final states
    [B, H, K, V] fp32.
    """
    if _backend(q) == "fla":
        from k3run.kernels.kda.fla import kda_fla

        return kda_fla(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens, decode=False
        )
    if not q.is_cuda and not torch.compiler.is_compiling():
        from k3run.kernels import cpu_simd

        if cpu_simd.available():  # x86 CPUs: token by token in C++, each state kept in cache for its prompt
            _check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
            n, h, kd = len(cu_seqlens) - 1, q.shape[1], q.shape[2]
            state = (
                initial_state.to(torch.float32).clone(memory_format=torch.contiguous_format)
                if initial_state is not None
                else q.new_zeros(n, h, kd, v.shape[-1], dtype=torch.float32)
            )
            o = cpu_simd.kda_prefill_recurrent(
                (q.float() * scale).contiguous(), k.float().contiguous(), v.float().contiguous(),
                g.float().exp().contiguous(), beta.float().contiguous(), state, cu_seqlens,
            )  # fmt: skip
            return o, state
    return chunk_kda_ref(q, k, v, g, beta, scale, initial_state, cu_seqlens)


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen KDA token by token (decode); same contract as chunk_kda."""
    if _backend(q) == "fla":
        from k3run.kernels.kda.fla import kda_fla

        return kda_fla(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens, decode=True
        )
    return recurrent_kda_ref(q, k, v, g, beta, scale, initial_state, cu_seqlens)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU with conv states; x [T, C], weight [C, W], states [B, C, W-1]."""
    y, final = causal_conv1d_planar(x, weight, cu_seqlens=cu_seqlens, initial_state=initial_state)
    return y[0], final


def causal_conv1d_planar(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
    groups: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """causal_conv1d with the output split into `groups` contiguous planes, y [groups, T, C / groups] (q, k, v
    for the recurrence). x may be a column slice of a wider tensor. One Triton launch on CUDA (plus the
    states' gather); on x86 CPUs with the SIMD extension one call for the sums (`cpu_simd.conv_prefill`,
    the reference's products and additions; its SiLU in torch, whose vectorised and scalar forms may round
    an element 1 ulp apart from the reference's); the reference elsewhere."""
    if x.is_cuda:
        from k3run.kernels.kda.conv import causal_conv1d_varlen_triton

        return causal_conv1d_varlen_triton(x, weight, cu_seqlens, initial_state, groups)
    T, C = x.shape
    if C % groups:
        raise ValueError(f"causal_conv1d: {C} channels do not split into {groups} groups")
    native = x.dtype in (torch.float32, torch.bfloat16) and x.stride(1) == 1 and weight.shape[-1] >= 2
    if native and not torch.compiler.is_compiling():
        from k3run.kernels import cpu_simd

        if cpu_simd.available():  # x86 CPUs: the sums in one call
            check_conv_inputs(x, weight, cu_seqlens, initial_state)
            acc, final = cpu_simd.conv_prefill(x, weight, cu_seqlens, initial_state)
            y = torch.nn.functional.silu(acc).to(x.dtype)
            return y.reshape(T, groups, C // groups).transpose(0, 1).contiguous(), final
    y, final = causal_conv1d_ref(x, weight, cu_seqlens, initial_state)
    return y.reshape(T, groups, C // groups).transpose(0, 1).contiguous(), final


def causal_conv1d_decode(
    x: torch.Tensor, weight: torch.Tensor, *, initial_state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """causal_conv1d for one token per sequence (x [B, C], states [B, C, W-1]), batched, device-only."""
    return causal_conv1d_decode_ref(x, weight, initial_state)


def causal_conv1d_decode_in_place(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    conv_pool: torch.Tensor,
    slots: torch.Tensor,
    context_lens: torch.Tensor,
    groups: int = 1,
    zero_pool: torch.Tensor | None = None,
) -> torch.Tensor:
    """causal_conv1d_decode with the states kept in the cache: sequence i's window is conv_pool[slots[i]]
    (zeros when context_lens[i] == 0) and its new window is written back there. x [B, C] (a column slice
    of a wider tensor is fine); weight [C, W]; conv_pool [S, C, W-1] in x's dtype. Returns y [groups, B,
    C / groups] (planar: each group contiguous). One Triton launch on CUDA; on x86 CPUs with the SIMD
    extension one call updating the windows in place (`cpu_simd.conv_decode_in_place`, the reference's
    bits); gather, reference and scatter elsewhere. zero_pool (CUDA only; the recurrent states of KDA's
    in-place decode): zero_pool[slots[i]] = 0 for every fresh sequence i in the same launch, so that
    `kda_decode_in_place(..., fresh_zeroed=True)` needs no launch of its own for it."""
    if x.is_cuda:
        from k3run.kernels.kda.conv import causal_conv1d_decode_in_place_triton

        return causal_conv1d_decode_in_place_triton(
            x, weight, conv_pool, slots, context_lens, groups, zero_pool=zero_pool
        )
    if zero_pool is not None:
        raise ValueError("causal_conv1d_decode_in_place: zero_pool is for the CUDA kernel only")
    B, C = x.shape
    if C % groups:
        raise ValueError(f"causal_conv1d_decode_in_place: {C} channels do not split into {groups} groups")
    if (
        not torch.compiler.is_compiling()
        and x.dtype in (torch.float32, torch.bfloat16)
        and conv_pool.dtype == x.dtype
        and conv_pool.is_contiguous()
        and x.stride(1) == 1
    ):
        from k3run.kernels import cpu_simd

        if cpu_simd.available():  # x86 CPUs: one call, the windows shifted in place
            wf = weight.float().contiguous()
            acc = cpu_simd.conv_decode_in_place(x, wf, conv_pool, slots, context_lens)
            y = torch.nn.functional.silu(acc).to(x.dtype)
            return y.reshape(B, groups, C // groups).transpose(0, 1).contiguous()
    state = torch.where((context_lens != 0)[:, None, None], conv_pool[slots], 0)
    y, final = causal_conv1d_decode_ref(x, weight, state)
    conv_pool[slots] = final.to(conv_pool.dtype)
    return y.reshape(B, groups, C // groups).transpose(0, 1).contiguous()
