"""Kimi Delta Attention in plain fp32 torch: the oracle every KDA kernel is compared with.

Conventions (fla layout): per head the state S is [K, V] (key-channel rows, value columns) and
    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,      o_t = S_t^T (scale * q_t)
with g the log-space per-channel decay, q and k already L2-normalised, beta already passed through sigmoid.
Varlen batches are flat [T, ...] tensors split by cu_seqlens [B+1]; states are [B, H, K, V].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Tokens per chunk of the chunked reference (the CPU's KDA prefill). The result is the same for any size (up
# to fp32 rounding: the error against the token-by-token recurrence was 3.2e-7 at 16 and 4.0e-7 at 64), but
# the pairwise decays cost H * C^2 * K per chunk: at H = 16, K = V = 128 and 512 tokens, 54 ms at 16 against
# 619 ms at 64 (fla's GPU kernels choose their own chunking).
CHUNK_SIZE = 16
L2NORM_EPS = 1e-6


def kda_gate(
    f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None
) -> torch.Tensor:
    """Log-space decay g [..., H, K] (fp32) from the raw forget-gate projection f [..., H, K].

    lower_bound None (Kimi Linear): g = -exp(A_log[h]) * softplus(f + dt_bias)   (softplus(z) = z for z > 20)
    lower_bound lb  (K3):          g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias)), so g in (lb, 0)
    A_log is [H] (per head, broadcast over K); dt_bias is [H*K].
    """
    H, K = f.shape[-2:]
    if A_log.numel() != H:
        raise ValueError(f"kda_gate: A_log must have H={H} elements, got shape {tuple(A_log.shape)}")
    if dt_bias.numel() != H * K:
        raise ValueError(
            f"kda_gate: dt_bias must have H*K={H * K} elements, got shape {tuple(dt_bias.shape)}"
        )
    z = f.float() + dt_bias.float().view(H, K)
    a = A_log.float().view(H, 1).exp()
    if lower_bound is None:
        return -a * F.softplus(z, beta=1.0, threshold=20.0)
    return lower_bound * torch.sigmoid(a * z)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim in fp32 (eps inside the sqrt, unlike F.normalize)."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)


def _check_kda_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
) -> None:
    T, H, K = q.shape
    V = v.shape[-1]
    expected = {"k": (T, H, K), "v": (T, H, V), "g": (T, H, K), "beta": (T, H)}
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if tuple(t.shape) != expected[name]:
            raise ValueError(f"kda: {name} must have shape {expected[name]}, got {tuple(t.shape)}")
    if torch.compiler.is_compiling():  # the eager warm-up of a compiled step checked these inputs
        return
    if cu_seqlens.dim() != 1 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != T:
        raise ValueError(f"kda: cu_seqlens must run from 0 to T={T}, got {cu_seqlens.tolist()}")
    B = cu_seqlens.numel() - 1
    if initial_state is not None and tuple(initial_state.shape) != (B, H, K, V):
        raise ValueError(
            f"kda: initial_state must have shape {(B, H, K, V)}, got {tuple(initial_state.shape)}"
        )


def recurrent_kda_seq(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, token by token. q, k, g [N, H, K]; v [N, H, V]; beta [N, H]; state [H, K, V] fp32.

    Returns o [N, H, V] fp32 and the state after the last token.
    """
    S = state.float().clone()
    o = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float32)
    for t in range(q.shape[0]):
        o[t], S = _delta_step(q[t], k[t], v[t], g[t], beta[t], scale, S)
    return o, S


def _delta_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    S: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One token of the gated delta rule, over any leading dims: q, k, g [..., H, K]; v [..., H, V]; beta
    [..., H]; S [..., H, K, V] fp32. Returns o [..., H, V] fp32 and the new state."""
    q_t, k_t, v_t = q.float() * scale, k.float(), v.float()
    S = S * g.float().exp().unsqueeze(-1)  # decay each key row
    pred = torch.einsum("...hk,...hkv->...hv", k_t, S)  # what the decayed state recalls for k_t
    S = S + torch.einsum("...hk,...hv->...hkv", beta.float().unsqueeze(-1) * k_t, v_t - pred)
    return torch.einsum("...hk,...hkv->...hv", q_t, S), S


def recurrent_kda_step_batched(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """recurrent_kda_seq's one step for B sequences of one token each, batched: q, k, g [B, H, K];
    v [B, H, V]; beta [B, H]; state [B, H, K, V] fp32 or None (zeros). Returns o [B, H, V] fp32 and the
    new states."""
    B, H, K = q.shape
    S = state.float() if state is not None else q.new_zeros(B, H, K, v.shape[-1], dtype=torch.float32)
    return _delta_step(q, k, v, g, beta, scale, S)


def chunk_kda_seq(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as recurrent_kda_seq, computed chunk by chunk (the algorithm of fla's chunk_kda).

    Within a chunk of C tokens with inclusive cumulative decay G [C, K] (per head):
      A[i, j]   = beta_i sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])   for j < i (strictly lower)
      Tm        = (I + A)^-1 Diag(beta)                              (UT transform)
      w = Tm (exp(G) * k),  u = Tm v                                 (the chunk's delta-rule pseudo values)
      v_new     = u - w S                                            (innovation against the entering state)
      o         = (scale q * exp(G)) S + Aqk v_new,  Aqk[i, j] = sum_d q_i k_j exp(G_i - G_j) for j <= i
      S        <- Diag(exp(G_last)) S + (exp(G_last - G) * k)^T v_new
    Decays are only ever exponentiated as differences G_i - G_j with j <= i, so nothing overflows even for
    long chunks with strong decay.
    """
    S = state.float().clone()  # [H, K, V]
    N = q.shape[0]
    o = q.new_zeros(N, q.shape[1], v.shape[-1], dtype=torch.float32)
    for start in range(0, N, chunk_size):
        end = min(start + chunk_size, N)
        C = end - start
        # head-major within the chunk: [H, C, ...]
        q_c = (q[start:end].float() * scale).transpose(0, 1)
        k_c = k[start:end].float().transpose(0, 1)
        v_c = v[start:end].float().transpose(0, 1)
        G = g[start:end].float().transpose(0, 1).cumsum(1)  # [H, C, K]
        b_c = beta[start:end].float().transpose(0, 1)  # [H, C]

        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # j <= i
        diff = G.unsqueeze(2) - G.unsqueeze(1)  # [H, C(i), C(j), K] = G_i - G_j
        decay = diff.masked_fill(~causal[None, :, :, None], float("-inf")).exp()
        kk = torch.einsum("hik,hjk,hijk->hij", k_c, k_c, decay)
        qk = torch.einsum("hik,hjk,hijk->hij", q_c, k_c, decay)  # inclusive diagonal: Aqk

        strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
        A = (b_c.unsqueeze(-1) * kk).masked_fill(~strict, 0.0)
        eye = torch.eye(C, dtype=torch.float32, device=q.device).expand(A.shape[0], C, C)
        Tm = torch.linalg.solve_triangular(eye + A, torch.diag_embed(b_c), upper=False, unitriangular=True)
        w = Tm @ (G.exp() * k_c)  # [H, C, K]
        u = Tm @ v_c  # [H, C, V]

        v_new = u - w @ S
        o[start:end] = ((q_c * G.exp()) @ S + qk @ v_new).transpose(0, 1)
        G_last = G[:, -1:, :]  # [H, 1, K]
        S = S * G_last.transpose(1, 2).exp() + ((G_last - G).exp() * k_c).transpose(1, 2) @ v_new
    return o, S


def _varlen(
    seq_fn,  # noqa: ANN001 - one of the two *_seq functions above
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    T, H, K = q.shape
    V = v.shape[-1]
    if torch.compiler.is_compiling():
        # a compiled step is a decode step, one token per sequence (engine/runner.py CompiledCpuDecoder):
        # every sequence's one token as one batched step, so the batch stays symbolic (no loop over it)
        if seq_fn is not recurrent_kda_seq:
            raise RuntimeError("kda: only the token-by-token reference runs inside a compiled step")
        return recurrent_kda_step_batched(q, k, v, g, beta, scale, initial_state)
    bounds = cu_seqlens.tolist()
    B = len(bounds) - 1
    o = q.new_zeros(T, H, V, dtype=torch.float32)
    final = q.new_zeros(B, H, K, V, dtype=torch.float32)
    for b in range(B):
        s, e = bounds[b], bounds[b + 1]
        h0 = initial_state[b] if initial_state is not None else q.new_zeros(H, K, V, dtype=torch.float32)
        o[s:e], final[b] = seq_fn(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], scale, h0)
    return o, final


def recurrent_kda_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen token-by-token KDA. q, k, g [T, H, K]; v [T, H, V]; beta [T, H]; initial_state [B, H, K, V]
    or None (zeros). Returns o [T, H, V] fp32 and the final states [B, H, K, V] fp32."""
    return _varlen(recurrent_kda_seq, q, k, v, g, beta, scale, initial_state, cu_seqlens)


def chunk_kda_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen chunked KDA (chunks of CHUNK_SIZE); same contract as recurrent_kda_ref."""
    return _varlen(chunk_kda_seq, q, k, v, g, beta, scale, initial_state, cu_seqlens)


def check_conv_inputs(
    x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None
) -> list[int]:
    """causal_conv1d's shape checks (x [T, C], weight [C, W], cu_seqlens from 0 to T, initial_state [B, C,
    W-1] or None); returns cu_seqlens as a host list."""
    T, C = x.shape
    if weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(f"causal_conv1d: weight must be [C={C}, W], got {tuple(weight.shape)}")
    W = weight.shape[1]
    bounds = cu_seqlens.tolist()
    B = len(bounds) - 1
    if bounds[0] != 0 or bounds[-1] != T:
        raise ValueError(f"causal_conv1d: cu_seqlens must run from 0 to T={T}, got {bounds}")
    if initial_state is not None and tuple(initial_state.shape) != (B, C, W - 1):
        raise ValueError(
            f"causal_conv1d: initial_state must be {(B, C, W - 1)}, got {tuple(initial_state.shape)}"
        )
    return bounds


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv (width W) followed by SiLU, per sequence, continuing from a conv state.

    x [T, C]; weight [C, W]; initial_state [B, C, W-1] holds each sequence's last W-1 inputs before this
    step (oldest first; zeros for a fresh sequence) or None for all-fresh.
    y_t[c] = silu(sum_j w[c, j] x_{t-W+1+j}[c]).
    Returns y [T, C] in x.dtype (fp32 accumulation) and the new states [B, C, W-1] in x.dtype.
    """
    T, C = x.shape
    W = weight.shape[-1]
    bounds = check_conv_inputs(x, weight, cu_seqlens, initial_state)
    B = len(bounds) - 1
    y = torch.zeros_like(x)
    final = x.new_zeros(B, C, W - 1)
    wf = weight.float()
    for b in range(B):
        s, e = bounds[b], bounds[b + 1]
        prev = initial_state[b] if initial_state is not None else x.new_zeros(C, W - 1)
        window = torch.cat([prev.to(x.dtype), x[s:e].transpose(0, 1)], dim=1)  # [C, W-1+n]
        n = e - s
        acc = torch.zeros(C, n, dtype=torch.float32, device=x.device)
        for j in range(W):
            acc += wf[:, j : j + 1] * window[:, j : j + n].float()
        y[s:e] = F.silu(acc).transpose(0, 1).to(x.dtype)
        final[b] = window[:, window.shape[1] - (W - 1) :]
    return y, final


def causal_conv1d_decode_ref(
    x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """causal_conv1d_ref when every sequence feeds one token (B = T), batched: no host read of cu_seqlens,
    the same fp32 operations per element (so the same bits). x [B, C]; weight [C, W]; initial_state
    [B, C, W-1] or None (all fresh). Returns y [B, C] in x.dtype and the new states [B, C, W-1]."""
    B, C = x.shape
    if weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(f"causal_conv1d: weight must be [C={C}, W], got {tuple(weight.shape)}")
    W = weight.shape[1]
    if initial_state is None:
        initial_state = x.new_zeros(B, C, W - 1)
    elif tuple(initial_state.shape) != (B, C, W - 1):
        raise ValueError(
            f"causal_conv1d: initial_state must be {(B, C, W - 1)}, got {tuple(initial_state.shape)}"
        )
    window = torch.cat([initial_state.to(x.dtype), x[:, :, None]], dim=2)  # [B, C, W]
    wf = weight.float()
    acc = torch.zeros(B, C, dtype=torch.float32, device=x.device)
    for j in range(W):
        acc += wf[:, j] * window[:, :, j].float()
    return F.silu(acc).to(x.dtype), window[:, :, 1:]


def kda_decode_fused_ref(
    qkv: torch.Tensor,
    b: torch.Tensor,
    f: torch.Tensor,
    gate: torch.Tensor,
    *,
    conv_weight: torch.Tensor,
    conv_pool: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    scale: float,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    context_lens: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The decode step in fp32 torch, the oracle of kernels/kda/decode.py (same contract): the conv on the
    gathered windows (zero for fresh sequences; its output kept in fp32, not rounded to qkv's dtype),
    l2norm, kda_gate and sigmoid(b), one delta-rule step on the gathered states, then
    RMSNorm(o) * norm_weight * sigmoid(gate); both pools updated at slots."""
    B, C = qkv.shape
    H = A_log.numel()
    P = C // 3
    K = P // H
    old = context_lens != 0
    window = torch.where(old[:, None, None], conv_pool[slots], 0)
    y, new_window = causal_conv1d_decode_ref(qkv.float(), conv_weight, window.float())  # q, k, v kept fp32
    q, k, v = (t.reshape(B, H, K) for t in y.split(P, dim=-1))
    state = torch.where(old[:, None, None, None], state_pool[slots], 0)
    g = kda_gate(f.reshape(B, H, K), A_log, dt_bias, lower_bound)
    o, new_state = recurrent_kda_step_batched(
        l2norm(q), l2norm(k), v, g, torch.sigmoid(b.float()), scale, state
    )
    conv_pool[slots] = new_window.to(conv_pool.dtype)
    state_pool[slots] = new_state
    normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    normed = normed * torch.sigmoid(gate.float().reshape(B, H, K))
    return normed.reshape(B, P).to(out_dtype or qkv.dtype)
