"""Kimi Delta Attention mixer (Kimi Linear and K3), tensor parallel over heads.

Rank-local computation for a flat batch x [T, D] of B sequences (the projections merged as vLLM's K3 model
merges them):
    in_proj(x)  K3:          [q | k | v | g | f_a | b]    (f_a replicated: every rank needs the whole latent)
                Kimi Linear: [q | k | v | b | f_a]        (output gate from g_b_proj(g_a_proj(x)))
    q, k, v  <- silu(causal depthwise conv, width W) continuing each sequence's conv state
    q, k     <- L2-normalised per head (eps inside the sqrt); the kernel scales q by K^-1/2
    g        <- kda_gate(f_b_proj(f_a), A_log, dt_bias, gate_lower_bound)   (fp32 log decay)
    beta     <- sigmoid(b) in fp32
    o        <- KDA recurrence from each sequence's state (zero for a fresh sequence), fp32
    out      <- o_proj(o_norm(o, gate))   (gated RMSNorm per head, row-parallel o_proj with all-reduce)
A CUDA decode step with a cache of up to K3RUN_KDA_FUSED_DECODE sequences (default 32) runs everything from
the conv to o_norm as one launch (`kda_decode_fused`); the CPU keeps the chain (its in-place C++ recurrence).

Checkpoint names -> parameters (model table): {q,k,v}_proj, g_proj, f_a_proj, b_proj -> in_proj shards
(see `in_proj_shard_ids`); {q,k,v}_conv1d.weight [P, 1, W] -> conv_weight shards 0/1/2, or a fused
conv1d.weight [3P, 1, W] -> conv_weight with shard None; A_log [H], [1, 1, H, 1] or (K3) [K] = H values then
zeros; dt_bias [H*K].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from k3run.distributed import NO_TP, TPInfo
from k3run.forward_context import ForwardContext, KDALayerCache
from k3run.kernels.kda import (
    causal_conv1d_decode,
    causal_conv1d_decode_in_place,
    causal_conv1d_planar,
    kda_decode_fused,
    kda_decode_in_place,
    kda_forward,
)
from k3run.knobs import knobs
from k3run.layers.branch import Branch
from k3run.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from k3run.layers.norm import GatedRMSNorm
from k3run.loader import SliceLoader, TensorSource

if TYPE_CHECKING:
    from k3run.quant.modelopt import QuantConfig

CONV_SHARD_NAMES = ("q_conv1d", "k_conv1d", "v_conv1d")


# (sequence, head) pairs from which the fused decode's programs take 64 value columns, not 32: alone
# (H100) 64/4/flat ran 1.07x faster at 32 sequences x 32 heads and 1.09-1.12x at 96 heads x 8 / 32, 2.5%
# slower at 8 x 32; in the full-depth Kimi Linear step +0.3% at batch 32, level at 16 / 24 (bench/RESULTS.md)
WIDE_FORM_PAIRS = 1024


def fused_form(sequences: int, heads: int) -> str:
    """The fused decode launch for `sequences` x `heads` (this rank's) state pairs: K3RUN_KDA_FUSED_FORM
    when set, else 64/4/flat from WIDE_FORM_PAIRS pairs and 32/4/flat below."""
    form = knobs().kda_fused_form
    if form is not None:
        return form
    return "64/4/flat" if sequences * heads >= WIDE_FORM_PAIRS else "32/4/flat"


def fused_form_kwargs(form: str) -> dict:
    """A fused decode launch form as K3RUN_KDA_FUSED_FORM spells it (BV/warps[/flat][/pN], checked by the
    knob's parser) -> `kda_decode_fused_triton` keywords."""
    bv, warps, *tail = form.split("/")
    persist = int(tail.pop()[1:]) if tail and tail[-1].startswith("p") else 0
    return dict(block_v=int(bv), num_warps=int(warps), flat_shift=bool(tail), persist=persist)


def fused_decode_takes(x: torch.Tensor, tokens: int) -> bool:
    """Whether a decode step of `tokens` sequences with the states in the cache runs as one fused launch: on
    CUDA up to K3RUN_KDA_FUSED_DECODE sequences. On the CPU the fused op is its fp32 torch reference, slower
    than the chain's in-place C++ step (`kda_decode_in_place`), so the CPU keeps the chain."""
    return x.is_cuda and tokens <= knobs().kda_fused_decode


def _adjacent_columns(*parts: torch.Tensor) -> torch.Tensor:
    """torch.cat(parts, -1) of 2-D tensors; a view without a copy when they are adjacent column slices of one
    tensor (as the merged in_proj's q | k | v outputs are)."""
    if torch.compiler.is_compiling():  # a compiled step fuses the copy (storage offsets are not traced)
        return torch.cat(parts, dim=-1)
    first = parts[0]
    offset = first.storage_offset()
    same = first.stride(-1) == 1
    for p in parts:
        same = same and p.stride() == first.stride() and p.storage_offset() == offset
        same = same and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        offset += p.shape[-1]
    if same:
        return first.as_strided((first.shape[0], sum(p.shape[-1] for p in parts)), first.stride())
    return torch.cat(parts, dim=-1)


class KimiDeltaAttention(nn.Module):
    """One KDA mixer on one TP rank (num_heads / tp heads).

    Checkpoint projections load into `in_proj` with shard id `in_proj_shard_ids[name]`; call each
    linear's and this module's `unfilled_parameters()` after loading to prove completeness.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        *,
        conv_kernel_size: int = 4,
        use_full_rank_gate: bool,
        gate_lower_bound: float | None,
        rms_norm_eps: float = 1e-5,
        qcfg: QuantConfig | None = None,
        prefix: str = "",
        tp: TPInfo = NO_TP,
        params_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        if gate_lower_bound is not None and not gate_lower_bound < 0:
            raise ValueError(f"{prefix}: gate_lower_bound must be negative or None, got {gate_lower_bound}")
        self.prefix = prefix
        self.tp = tp
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.conv_kernel_size = conv_kernel_size
        self.use_full_rank_gate = use_full_rank_gate
        self.gate_lower_bound = gate_lower_bound
        self.params_dtype = params_dtype
        self.local_heads = tp.shard(num_heads, f"{prefix}: KDA num_heads")  # H
        K = head_dim
        P = num_heads * K
        self.local_proj = self.local_heads * K  # P on this rank
        self.scale = K**-0.5

        lin = {"qcfg": qcfg, "tp": tp, "params_dtype": params_dtype}
        if use_full_rank_gate:
            names = ["q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj"]
            sizes = [P, P, P, P, K * tp.size, num_heads]
        else:
            names = ["q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj"]
            sizes = [P, P, P, num_heads, K * tp.size]
        self.in_proj_shard_ids = {name: i for i, name in enumerate(names)}
        self.in_proj = MergedColumnParallelLinear(
            hidden_size,
            sizes,
            replicated_shard_id=names.index("f_a_proj"),
            prefix=f"{prefix}.in_proj",
            shard_prefixes=[f"{prefix}.{n}" for n in names],
            **lin,
        )
        self.f_b_proj = ColumnParallelLinear(K, P, prefix=f"{prefix}.f_b_proj", **lin)
        if not use_full_rank_gate:
            self.g_a_proj = ReplicatedLinear(hidden_size, K, prefix=f"{prefix}.g_a_proj", **lin)
            self.g_b_proj = ColumnParallelLinear(K, P, prefix=f"{prefix}.g_b_proj", **lin)
        # fp32 like the norm's math: K3 stores o_norm.weight F32, which a 16-bit weight would round
        self.o_norm = GatedRMSNorm(K, eps=rms_norm_eps, params_dtype=torch.float32)
        self.o_proj = RowParallelLinear(P, hidden_size, prefix=f"{prefix}.o_proj", **lin)

        # fp32 like the upstream kernels: the gate parameters feed exp() and the conv accumulates in fp32
        H = self.local_heads
        self.A_log = nn.Parameter(torch.zeros(H, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.zeros(H * K, dtype=torch.float32), requires_grad=False)
        self.conv_weight = nn.Parameter(
            torch.zeros(3 * self.local_proj, conv_kernel_size, dtype=torch.float32), requires_grad=False
        )  # [3P, W], rank-local rows [q | k | v]
        self.A_log.weight_loader = SliceLoader(self._load_A_log)  # type: ignore[attr-defined]
        self.dt_bias.weight_loader = SliceLoader(self._load_dt_bias)  # type: ignore[attr-defined]
        self.conv_weight.weight_loader = SliceLoader(self._load_conv)  # type: ignore[attr-defined]
        self._filled: set[str] = set()

    # weight loading

    def _mark(self, what: str) -> None:
        if what in self._filled:
            raise ValueError(f"{self.prefix}.{what}: loaded twice")
        self._filled.add(what)

    def _load_A_log(self, param: nn.Parameter, loaded: TensorSource, shard_id: object = None) -> None:
        H, K = self.num_heads, self.head_dim
        if shard_id is not None:
            raise ValueError(f"{self.prefix}.A_log: unexpected shard id {shard_id!r}")
        # legacy checkpoints store A_log as [1, 1, H, 1]; K3 pads it to [K]: H per-head values, then zeros
        shapes = [(H,), (1, 1, H, 1)] + ([(K,)] if K > H else [])
        if tuple(loaded.shape) not in shapes:
            raise ValueError(
                f"{self.prefix}.A_log: expected shape {' or '.join(str(s) for s in shapes)} (per-head values"
                f"{f', or padded with zeros to head_dim {K}' if K > H else ''}), got {tuple(loaded.shape)}"
            )
        flat = loaded.read().reshape(-1)
        if flat.numel() == K > H:
            tail = flat[H:]
            bad = (tail != 0).nonzero()
            if bad.numel():
                i = int(bad[0, 0])
                raise ValueError(
                    f"{self.prefix}.A_log: shape ({K},) holds {H} per-head values and must be zero after "
                    f"them, found {int(bad.numel())} nonzero (first at index {H + i}: {float(tail[i])!r})"
                )
            flat = flat[:H]
        start = self.tp.rank * self.local_heads
        param.data.copy_(flat[start : start + self.local_heads].float())
        self._mark("A_log")

    def _load_dt_bias(self, param: nn.Parameter, loaded: TensorSource, shard_id: object = None) -> None:
        n = self.num_heads * self.head_dim
        if shard_id is not None:
            raise ValueError(f"{self.prefix}.dt_bias: unexpected shard id {shard_id!r}")
        if tuple(loaded.shape) != (n,):
            raise ValueError(f"{self.prefix}.dt_bias: expected shape ({n},), got {loaded.shape}")
        param.data.copy_(loaded.narrow(0, self.tp.rank * self.local_proj, self.local_proj).read().float())
        self._mark("dt_bias")

    def _load_conv(self, param: nn.Parameter, loaded: TensorSource, shard_id: object = None) -> None:
        """shard_id 0/1/2 (or "q"/"k"/"v"): one of q/k/v_conv1d.weight [P, 1, W]; None: fused [3P, 1, W]."""
        P, W, Pl = self.num_heads * self.head_dim, self.conv_kernel_size, self.local_proj
        ids = {"q": 0, "k": 1, "v": 2, 0: 0, 1: 1, 2: 2}
        if shard_id is None:
            parts, expected = [0, 1, 2], 3 * P
        elif shard_id in ids:
            parts, expected = [ids[shard_id]], P  # type: ignore[index]
        else:
            raise ValueError(f"{self.prefix}.conv_weight: shard id must be 0, 1, 2 or None, got {shard_id!r}")
        if tuple(loaded.shape) not in ((expected, 1, W), (expected, W)):
            raise ValueError(
                f"{self.prefix}.conv_weight (shard {shard_id}): expected shape ({expected}, 1, {W}), "
                f"got {loaded.shape}"
            )
        for j, part in enumerate(parts):
            src = loaded.narrow(0, j * P + self.tp.rank * Pl, Pl).read().reshape(Pl, W)
            param.data[part * Pl : (part + 1) * Pl].copy_(src.float())
            self._mark(CONV_SHARD_NAMES[part])

    def unfilled_parameters(self) -> list[str]:
        """This module's own parameters (not its linears') that no loader call has filled yet."""
        names = ["A_log", "dt_bias", *CONV_SHARD_NAMES]
        return [n for n in names if n not in self._filled]

    # cache

    def cache_shapes(self, num_slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv [S, 3P, W-1], recurrent [S, H, K, V]) for this rank."""
        H, K = self.local_heads, self.head_dim
        return (num_slots, 3 * self.local_proj, self.conv_kernel_size - 1), (num_slots, H, K, K)

    def init_cache(self, num_slots: int, dtype: torch.dtype, device: torch.device | str) -> KDALayerCache:
        """Zeroed cache: conv state in the activation dtype `dtype`, recurrent state in fp32."""
        conv_shape, rec_shape = self.cache_shapes(num_slots)
        return KDALayerCache(
            conv=torch.zeros(conv_shape, dtype=dtype, device=device),
            recurrent=torch.zeros(rec_shape, dtype=torch.float32, device=device),
        )

    def _initial_states(
        self,
        ctx: ForwardContext,
        cache: KDALayerCache | None,
        dtype: torch.dtype,
        device: torch.device,
        gather: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Each sequence's conv and recurrent state before this step; zeros for a fresh sequence.
        gather=False: only check the cache (a decode step reads and updates the states in the cache)."""
        if cache is None:
            if any(c != 0 for c in ctx.context_lens_list):
                raise ValueError(f"{self.prefix}: context_lens {ctx.context_lens_list} need a KDA cache")
            return None, None
        if ctx.slots is None:
            raise ValueError(f"{self.prefix}: a cache was given but ctx.slots is None")
        conv_shape, rec_shape = self.cache_shapes(cache.conv.shape[0])
        if tuple(cache.conv.shape) != conv_shape or tuple(cache.recurrent.shape) != rec_shape:
            raise ValueError(
                f"{self.prefix}: cache shapes conv {tuple(cache.conv.shape)} / recurrent "
                f"{tuple(cache.recurrent.shape)} do not match the layer's {conv_shape} / {rec_shape}"
            )
        if cache.recurrent.dtype != torch.float32:
            raise ValueError(f"{self.prefix}: recurrent state must be fp32, got {cache.recurrent.dtype}")
        if not gather:
            return None, None
        if not ctx.is_static and all(c == 0 for c in ctx.context_lens_list):
            return None, None  # every sequence starts fresh: zero states, as without a cache
        conv0 = cache.conv[ctx.slots].to(dtype)  # [B, 3P, W-1]
        rec0 = cache.recurrent[ctx.slots]  # [B, H, K, V]
        if ctx.is_static or any(c == 0 for c in ctx.context_lens_list):
            # a reused slot still holds its previous owner's state: zero the fresh rows with a device mask
            # (no host copy, so no synchronisation)
            old = (ctx.context_lens != 0)[:, None, None]
            return torch.where(old, conv0, 0), torch.where(old[..., None], rec0, 0)
        return conv0, rec0

    # forward

    def forward(
        self, x: torch.Tensor, ctx: ForwardContext, layer_cache: KDALayerCache | None
    ) -> torch.Tensor:
        """x [T, D] (the normed layer input) -> [T, D]; updates layer_cache at ctx.slots when given."""
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"{self.prefix}: expected x [T, {self.hidden_size}], got {tuple(x.shape)}")
        T = x.shape[0]
        H, K, Pl = self.local_heads, self.head_dim, self.local_proj
        # decode with a cache: the conv and the recurrence read and update their states in the cache
        in_place = ctx.is_decode and layer_cache is not None and layer_cache.conv.dtype == x.dtype
        conv0, rec0 = self._initial_states(ctx, layer_cache, x.dtype, x.device, gather=not in_place)

        gate_branch = None
        if not self.use_full_rank_gate:  # the low-rank output gate beside the conv and the recurrence
            g_a, g_b = self.g_a_proj, self.g_b_proj
            gate_branch = Branch(lambda: g_b(g_a(x)), x)  # [T, P]; no collective (column-parallel, local)
        parts = self.in_proj.split(self.in_proj(x))
        if self.use_full_rank_gate:
            q, k, v, gate, f_a, b = parts
        else:
            q, k, v, b, f_a = parts
        if in_place and fused_decode_takes(x, T):  # conv, recurrence and o_norm in one launch
            assert layer_cache is not None and ctx.slots is not None
            f = self.f_b_proj(f_a)
            if gate_branch is not None:
                gate = gate_branch.result()
            o = kda_decode_fused(
                _adjacent_columns(q, k, v), b, f, gate, conv_weight=self.conv_weight,
                conv_pool=layer_cache.conv, A_log=self.A_log, dt_bias=self.dt_bias,
                lower_bound=self.gate_lower_bound, scale=self.scale, state_pool=layer_cache.recurrent,
                slots=ctx.slots, context_lens=ctx.context_lens, norm_weight=self.o_norm.weight,
                eps=self.o_norm.eps, out_dtype=x.dtype, **fused_form_kwargs(fused_form(T, H)),
            )  # fmt: skip
            return self.o_proj(o)
        # the raw forget-gate projection: with K3RUN_KDA_FB_SIDE a branch beside the conv (queued after the
        # gate branch), else in the chain after the conv
        f_branch = Branch(lambda: self.f_b_proj(f_a), x) if knobs().kda_fb_side else None
        conv_final = None
        if in_place:  # one launch on CUDA: states in the cache, q | k | v read in place, planar output
            assert layer_cache is not None and ctx.slots is not None
            # on CUDA the same launch zeroes the fresh sequences' recurrent states (read by the next one)
            fresh = layer_cache.recurrent if x.is_cuda else None
            q, k, v = causal_conv1d_decode_in_place(
                _adjacent_columns(q, k, v), self.conv_weight, conv_pool=layer_cache.conv, slots=ctx.slots,
                context_lens=ctx.context_lens, groups=3, zero_pool=fresh,
            ).reshape(3, T, H, K)  # fmt: skip
        elif ctx.is_decode:  # one token per sequence: batched, no host read of cu_seqlens
            qkv, conv_final = causal_conv1d_decode(
                torch.cat([q, k, v], dim=-1), self.conv_weight, initial_state=conv0
            )
            q, k, v = (t.reshape(T, H, K) for t in qkv.split(Pl, dim=-1))
        else:  # q | k | v read in place, planar output (one launch on CUDA)
            planes, conv_final = causal_conv1d_planar(
                _adjacent_columns(q, k, v), self.conv_weight, cu_seqlens=ctx.cu_seqlens, initial_state=conv0,
                groups=3,
            )  # fmt: skip
            q, k, v = planes.reshape(3, T, H, K)
        f = (f_branch.result() if f_branch is not None else self.f_b_proj(f_a)).reshape(T, H, K)
        # gate, beta sigmoid and q/k L2 norm happen inside kda_forward (in-kernel on the fla GPU path)
        gate_args = dict(
            A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=self.gate_lower_bound, scale=self.scale
        )
        if in_place:
            assert layer_cache is not None and ctx.slots is not None
            o = kda_decode_in_place(
                q, k, v, f, b, **gate_args, state_pool=layer_cache.recurrent, slots=ctx.slots,
                context_lens=ctx.context_lens, cu_seqlens=ctx.cu_seqlens, fresh_zeroed=x.is_cuda,
            )  # fmt: skip
        else:
            o, rec_final = kda_forward(
                q, k, v, f, b, **gate_args, initial_state=rec0, cu_seqlens=ctx.cu_seqlens,
                decode=ctx.is_decode, graph=ctx.padded_prefill,
                cu_seqlens_cpu=None if ctx.is_decode or ctx.padded_prefill else ctx.cu_seqlens_host(),
            )  # fmt: skip
            if layer_cache is not None:
                assert conv_final is not None
                layer_cache.recurrent[ctx.slots] = rec_final
                layer_cache.conv[ctx.slots] = conv_final.to(layer_cache.conv.dtype)

        if gate_branch is not None:
            gate = gate_branch.result()
        o = self.o_norm(o, gate.reshape(T, H, K), out_dtype=x.dtype)  # fp32 math, [T, H, V]
        return self.o_proj(o.reshape(T, Pl))

    def extra_repr(self) -> str:
        gate = "full-rank g_proj" if self.use_full_rank_gate else "low-rank g_a/g_b"
        decay = (
            "softplus" if self.gate_lower_bound is None else f"sigmoid lower bound {self.gate_lower_bound}"
        )
        return f"heads={self.local_heads}/{self.num_heads}, head_dim={self.head_dim}, {gate}, decay={decay}"
