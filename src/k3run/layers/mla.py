"""Kimi gated NoPE MLA (Kimi Linear and K3, as in Moonshot's modeling code), tensor parallel over heads.

Per token, with d_q = d_n + R, latent width L and this rank's H heads:
    q            = q_b_proj(q_a_layernorm(q_a_proj(x)))  (K3, q_lora)   or  q_proj(x)  (Kimi Linear)  [H, d_q]
    [c | k_pe]   = kv_a_proj_with_mqa(x);  c <- kv_a_layernorm(c)         (latent [L], shared key dims [R])
    [k_nope | v] = kv_b_proj(c) per head                                   (expanded form)
    o_h          = softmax_causal(q_h . [k_nope_h ; k_pe] / sqrt(d_q)) v_h   (fp32; no RoPE anywhere)
    out          = o_proj(o * sigmoid(g_proj(x)))   (K3 gate on the layer input; Kimi Linear: no gate)
The latents (q_a_proj, kv_a_proj_with_mqa) are replicated on every rank; heads are split at q_b_proj / q_proj
/ kv_b_proj / g_proj (column parallel) and o_proj is row parallel (all-reduce).

The cache keeps per token only the normalised latent c and k_pe ([L + R], MLALayerCache). Two equivalent
attention forms read it:
- expanded ("naive"): kv_b_proj applied to every cached latent, then ordinary multi-head attention (on CUDA
  with 16-bit activations through torch's fused attention kernels, else in fp32);
- absorbed: W_UK folded into the query (q~_h = W_UK_h^T q_nope_h in R^L) and W_UV applied after attending
  over the latents, so kv_b_proj never runs over the context. Default: absorbed for decode steps only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from k3run.distributed import NO_TP, TPInfo
from k3run.forward_context import ForwardContext, MLALayerCache
from k3run.kernels.cpu_simd import mla_decode as mla_decode_cpu
from k3run.kernels.cpu_simd import mla_decode_applies
from k3run.kernels.mla import (
    absorb_kernels_enabled,
    decode_kernel_enabled,
    mla_decode_absorbed,
    mla_decode_attention,
    mla_latent_store,
)
from k3run.layers.branch import Branch
from k3run.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from k3run.layers.norm import RMSNorm
from k3run.quant.algo import QuantAlgo

if TYPE_CHECKING:
    from k3run.quant.modelopt import QuantConfig

AbsorbMode = Literal["decode", "always", "never"]
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class KimiMLA(nn.Module):
    """One gated NoPE MLA mixer on one TP rank (num_heads / tp heads).

    Submodules carry the checkpoint names (q_a_proj, q_a_layernorm, q_b_proj or q_proj, kv_a_proj_with_mqa,
    kv_a_layernorm, kv_b_proj, g_proj, o_proj). After loading, call `process_after_loading()` (it builds
    the absorbed kv_b factors). `absorb` picks the attention form: "decode" (absorbed for pure decode
    steps, expanded otherwise), "always" or "never"; all three compute the same function.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        use_output_gate: bool,
        latent_norm_eps: float = 1e-6,
        absorb: AbsorbMode = "decode",
        qcfg: QuantConfig | None = None,
        prefix: str = "",
        tp: TPInfo = NO_TP,
        params_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        if absorb not in ("decode", "always", "never"):
            raise ValueError(f"{prefix}: absorb must be 'decode', 'always' or 'never', got {absorb!r}")
        self.prefix = prefix
        self.tp = tp
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.local_heads = tp.shard(num_heads, f"{prefix}: MLA num_attention_heads")
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.use_output_gate = use_output_gate
        self.absorb = absorb
        self.params_dtype = params_dtype
        self.scale = self.qk_head_dim**-0.5  # NoPE: no yarn mscale

        lin = {"qcfg": qcfg, "tp": tp, "params_dtype": params_dtype}
        if q_lora_rank is not None:
            self.q_a_proj = ReplicatedLinear(hidden_size, q_lora_rank, prefix=f"{prefix}.q_a_proj", **lin)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps=latent_norm_eps, params_dtype=params_dtype)
            self.q_b_proj = ColumnParallelLinear(
                q_lora_rank, num_heads * self.qk_head_dim, prefix=f"{prefix}.q_b_proj", **lin
            )
        else:
            self.q_proj = ColumnParallelLinear(
                hidden_size, num_heads * self.qk_head_dim, prefix=f"{prefix}.q_proj", **lin
            )
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            hidden_size, kv_lora_rank + qk_rope_head_dim, prefix=f"{prefix}.kv_a_proj_with_mqa", **lin
        )
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps=latent_norm_eps, params_dtype=params_dtype)
        self.kv_b_proj = ColumnParallelLinear(
            kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), prefix=f"{prefix}.kv_b_proj", **lin
        )
        if use_output_gate:
            self.g_proj = ColumnParallelLinear(
                hidden_size, num_heads * v_head_dim, prefix=f"{prefix}.g_proj", **lin
            )
        self.o_proj = RowParallelLinear(num_heads * v_head_dim, hidden_size, prefix=f"{prefix}.o_proj", **lin)
        # absorbed kv_b_proj factors, fp32, set by process_after_loading
        self.register_buffer("w_uk", None, persistent=False)  # [H, d_n, L]
        self.register_buffer("w_uv", None, persistent=False)  # [H, d_v, L]

    def kv_b_input_dtype(self) -> torch.dtype:
        """The dtype the cached latent is given to kv_b_proj in (cf. vLLM `_get_kv_b_proj_input_dtype`).

        Unquantized: the weight dtype. FP8_PB_WO quantizes its own high-precision input per token and
        128 columns, and an fp8 latent would carry no scales, so it gets the activation dtype; NVFP4
        here is weight-only and also takes the activation dtype. Never an fp8 dtype.
        """
        if self.kv_b_proj.scheme.algo is QuantAlgo.NONE:  # type: ignore[attr-defined]
            return self.kv_b_proj.weight.dtype
        return self.params_dtype

    def process_after_loading(self) -> None:
        """Split the (dequantized) kv_b_proj weight into the absorbed factors W_UK and W_UV, once.

        Must run after every kv_b_proj tensor is loaded; it is independent of whether kv_b_proj's own
        scheme processing has run yet.
        """
        H, dn, dv, L = self.local_heads, self.qk_nope_head_dim, self.v_head_dim, self.kv_lora_rank
        w = self.kv_b_proj.dequantized_weight().reshape(H, dn + dv, L)  # fp32, rows per head [k_nope | v]
        self.w_uk = w[:, :dn].contiguous()
        self.w_uv = w[:, dn:].contiguous()

    # cache

    def cache_shape(self, num_slots: int, max_len: int) -> tuple[int, int, int]:
        """[S, max_len, L + R]: replicated on every rank (the latent is shared by all heads)."""
        return num_slots, max_len, self.kv_lora_rank + self.qk_rope_head_dim

    def init_cache(
        self, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device | str
    ) -> MLALayerCache:
        return MLALayerCache(
            latent=torch.zeros(self.cache_shape(num_slots, max_len), dtype=dtype, device=device)
        )

    def _sequence_latents(
        self, latent: torch.Tensor, ctx: ForwardContext, cache: MLALayerCache | None
    ) -> list[torch.Tensor]:
        """Store this step's latents and return each sequence's whole latent history [ctx + n, L + R]."""
        bounds = ctx.bounds()
        if cache is None:
            if any(c != 0 for c in ctx.context_lens_list):
                raise ValueError(f"{self.prefix}: context_lens {ctx.context_lens_list} need an MLA cache")
            return [latent[bounds[b] : bounds[b + 1]] for b in range(ctx.num_seqs)]
        if ctx.slots is None:
            raise ValueError(f"{self.prefix}: a cache was given but ctx.slots is None")
        store = cache.latent
        if store.dim() != 3 or store.shape[2] != latent.shape[1]:
            raise ValueError(
                f"{self.prefix}: latent cache must be [S, max_len, {latent.shape[1]}], "
                f"got {tuple(store.shape)}"
            )
        slots = ctx.slots_list
        out = []
        for b in range(ctx.num_seqs):
            s, e, start = bounds[b], bounds[b + 1], ctx.context_lens_list[b]
            end = start + (e - s)
            if end > store.shape[1]:
                raise ValueError(
                    f"{self.prefix}: sequence {b} needs {end} cached tokens, the cache holds {store.shape[1]}"
                )
            store[slots[b], start:end] = latent[s:e].to(store.dtype)
            out.append(store[slots[b], :end])
        return out

    # attention

    def _attend_expanded(
        self, q: torch.Tensor, lats: list[torch.Tensor], ctx: ForwardContext
    ) -> list[torch.Tensor]:
        H, dn, dv, L = self.local_heads, self.qk_nope_head_dim, self.v_head_dim, self.kv_lora_rank
        c_all = torch.cat([lat[:, :L] for lat in lats]).to(self.kv_b_input_dtype())  # [N, L]
        if c_all.dtype in _FP8_DTYPES:
            raise AssertionError(f"{self.prefix}: kv_b_proj must never see an fp8 latent")
        kv = self.kv_b_proj(c_all).reshape(-1, H, dn + dv)  # one GEMM over every sequence's context
        if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
            return self._attend_flash(q, kv, lats, ctx)
        return self._attend_expanded_fp32(q, kv, lats, ctx)

    def _attend_expanded_fp32(
        self, q: torch.Tensor, kv: torch.Tensor, lats: list[torch.Tensor], ctx: ForwardContext
    ) -> list[torch.Tensor]:
        """The expanded form in fp32 (every device): scores [H, n, N] per sequence, a masked softmax."""
        dn, L = self.qk_nope_head_dim, self.kv_lora_rank
        outs = []
        pos = 0
        bounds = ctx.bounds()
        for b, lat in enumerate(lats):
            N = lat.shape[0]
            kv_b = kv[pos : pos + N].float()
            pos += N
            k_pe = lat[:, L:].float()  # [N, R], shared by all heads
            q_b = q[bounds[b] : bounds[b + 1]].float()  # [n, H, d_q]
            scores = torch.einsum("thd,shd->hts", q_b[..., :dn], kv_b[..., :dn])
            scores = scores + torch.einsum("thr,sr->hts", q_b[..., dn:], k_pe)
            p = self._causal_softmax(scores * self.scale, ctx.context_lens_list[b])
            outs.append(torch.einsum("hts,shv->thv", p, kv_b[..., dn:]))  # [n, H, d_v]
        return outs

    def _attend_flash(
        self, q: torch.Tensor, kv: torch.Tensor, lats: list[torch.Tensor], ctx: ForwardContext
    ) -> list[torch.Tensor]:
        """The expanded form on the tensor cores (CUDA, 16-bit): torch's fused attention (flash / memory-
        efficient kernels) over q [n, H, d_q] and the expanded keys [k_nope_h ; k_pe] and values of each
        sequence, causal from the bottom right (the n queries are the last n of the N positions). The inputs
        are the same 16-bit values the fp32 form widens; the kernels keep fp32 softmax statistics and
        accumulators and round the probabilities to 16 bits for the PV product, one output rounding."""
        from torch.nn.attention.bias import causal_lower_right

        H, dn, L = self.local_heads, self.qk_nope_head_dim, self.kv_lora_rank
        outs = []
        pos = 0
        bounds = [0, q.shape[0]] if ctx.padded_prefill else ctx.bounds()  # padded: all rows, one causal run
        for b, lat in enumerate(lats):
            N = lat.shape[0]
            kv_b = kv[pos : pos + N]
            pos += N
            q_b = q[bounds[b] : bounds[b + 1]]  # [n, H, d_q]
            n = q_b.shape[0]
            k_pe = lat[:, None, L:].to(q.dtype).expand(N, H, -1)
            k = torch.cat([kv_b[..., :dn], k_pe], dim=-1)  # [N, H, d_q]
            v = kv_b[..., dn:]
            mask = None if n == N else causal_lower_right(n, N)
            o = torch.nn.functional.scaled_dot_product_attention(
                q_b.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                attn_mask=mask, is_causal=n == N, scale=self.scale,
            )  # fmt: skip
            outs.append(o[0].transpose(0, 1).float())  # [n, H, d_v]
        return outs

    def _attend_absorbed(
        self, q: torch.Tensor, lats: list[torch.Tensor], ctx: ForwardContext
    ) -> list[torch.Tensor]:
        if self.w_uk is None or self.w_uv is None:
            raise RuntimeError(f"{self.prefix}: call process_after_loading() before absorbed attention")
        dn, L = self.qk_nope_head_dim, self.kv_lora_rank
        bounds = ctx.bounds()
        outs = []
        for b, lat in enumerate(lats):
            q_b = q[bounds[b] : bounds[b + 1]].float()  # [n, H, d_q]
            # the scores as one product of the joined query [q_lat ; q_pe] with the cached rows [c ; k_pe]
            q_lat = torch.einsum("thd,hdl->thl", q_b[..., :dn], self.w_uk)  # [n, H, L]
            n, H = q_lat.shape[:2]
            q_join = torch.cat([q_lat, q_b[..., dn:]], dim=-1).transpose(0, 1)  # [H, n, L + R]
            last = ctx.context_lens_list[b] == lat.shape[0] - 1  # the query sees every cached row
            if n == 1 and last and mla_decode_applies(q_join[:, 0], lat, L):
                # one decode query over every cached row: the CPU kernel reads the bf16 rows in place
                o_lat = mla_decode_cpu(q_join[:, 0], lat, L, self.scale)[None]  # [1, H, L]
            else:
                lat_f = lat.float()  # [N, L + R]
                scores = (q_join.reshape(H * n, -1) @ lat_f.T).view(H, n, -1)  # [H, n, N]
                p = self._causal_softmax(scores * self.scale, ctx.context_lens_list[b])
                o_lat = (p.view(H * n, -1) @ lat_f[:, :L]).view(H, n, L).transpose(0, 1)  # [n, H, L]
            outs.append(torch.einsum("thl,hvl->thv", o_lat, self.w_uv))  # [n, H, d_v]
        return outs

    def static_attention_bytes(self, batch: int, window: int) -> int:
        """An upper estimate of the temporaries `_attend_static` holds for `batch` sequences and an attention
        window of `window` positions: the gathered window in the activation dtype and its fp32 copy
        [B, W, L + R], and up to four fp32 score-sized tensors [B, H, W] (two score terms, their sum, the
        masked and softmaxed probabilities). At K3's widths: ~5 KB per (sequence, position)."""
        act = torch.empty((), dtype=self.params_dtype).element_size()
        width = self.kv_lora_rank + self.qk_rope_head_dim
        if decode_kernel_enabled(self.w_uk.device if self.w_uk is not None else torch.device("cpu")):
            # the split kernel's partial outputs: at most one split per 64 positions, [B, splits, H, L + 1]
            return batch * -(-window // 64) * self.local_heads * (self.kv_lora_rank + 1) * 4
        return batch * window * (width * (act + 4) + 4 * 4 * self.local_heads)

    def _attend_static(
        self, q: torch.Tensor, kv_a: torch.Tensor, ctx: ForwardContext, cache: MLALayerCache | None
    ) -> torch.Tensor:
        """A static decode step (ctx.attn_window, one token per sequence, T = B): store each sequence's new
        latent (from kv_a [B, L + R]) at position context_lens[b] of its slot, then absorbed attention over
        the first attn_window positions of the slot with the positions after context_lens[b] masked. Device
        tensors only, so a CUDA graph can capture it. q [B, H, d_q] -> [B, H, d_v] fp32; where
        `absorb_kernels_enabled` (CUDA, up to K3RUN_MLA_ABSORB_KERNELS sequences), the four launches of
        `mla_decode_absorbed` after one that normalises and stores the latent, the output in the activation
        dtype unless an output gate follows."""
        if cache is None or ctx.slots is None:
            raise ValueError(f"{self.prefix}: a static decode step needs the MLA cache and ctx.slots")
        if self.w_uk is None or self.w_uv is None:
            raise RuntimeError(f"{self.prefix}: call process_after_loading() before absorbed attention")
        store, W = cache.latent, ctx.attn_window
        assert W is not None
        width = kv_a.shape[1]
        if store.dim() != 3 or store.shape[2] != width or W > store.shape[1]:
            raise ValueError(
                f"{self.prefix}: latent cache must be [S, >= {W}, {width}] for a static step of window {W}, "
                f"got {tuple(store.shape)}"
            )
        if absorb_kernels_enabled(q.device, q.shape[0]) and decode_kernel_enabled(q.device):
            norm = self.kv_a_layernorm
            mla_latent_store(kv_a, norm.weight, norm.eps, store, ctx.slots, ctx.context_lens)
            # [B, H, d_v] in the activation dtype (fp32 where an output gate follows, applied in fp32)
            out_dtype = torch.float32 if self.use_output_gate else q.dtype
            return mla_decode_absorbed(
                q, self.w_uk, self.w_uv, store, ctx.slots, ctx.context_lens, W, self.scale, out_dtype
            )
        store[ctx.slots, ctx.context_lens] = self._latent(kv_a).to(store.dtype)
        dn = self.qk_nope_head_dim
        qf = q.float()
        q_lat = torch.einsum("bhd,hdl->bhl", qf[..., :dn], self.w_uk)  # [B, H, L]
        o_lat = mla_decode_attention(q_lat, qf[..., dn:], store, ctx.slots, ctx.context_lens, W, self.scale)
        return torch.einsum("bhl,hvl->bhv", o_lat, self.w_uv)  # [B, H, d_v]

    def _attend_padded_prefill(
        self, q: torch.Tensor, latent: torch.Tensor, ctx: ForwardContext, cache: MLALayerCache | None
    ) -> torch.Tensor:
        """A padded prefill (ctx.padded_prefill: one fresh sequence of n tokens, rows n..T-1 padding): row r
        stores its latent at position r of slots[0] (r < n) or r - n of slots[1] (the padding's scratch
        slot), then the expanded attention over all T rows, causal. A real row attends to rows before it only,
        all of its own sequence, so it gets exactly `_attend_flash`'s attention of the unpadded sequence.
        Device tensors only, so a CUDA graph can capture it. q [T, H, d_q], latent [T, L + R] -> [T, H, d_v]
        fp32."""
        if cache is None or ctx.slots is None:
            raise ValueError(f"{self.prefix}: a padded prefill needs the MLA cache and ctx.slots")
        if not (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)):
            raise ValueError(f"{self.prefix}: a padded prefill runs the 16-bit CUDA attention, got {q.dtype}")
        store, T = cache.latent, q.shape[0]
        if store.dim() != 3 or store.shape[2] != latent.shape[1] or T > store.shape[1]:
            raise ValueError(
                f"{self.prefix}: latent cache must be [S, >= {T}, {latent.shape[1]}] for a padded prefill of "
                f"{T} rows, got {tuple(store.shape)}"
            )
        rows = torch.arange(T, device=q.device)
        n = ctx.cu_seqlens[1]
        real = rows < n
        lat = latent.to(store.dtype)  # what the unpadded path reads back from the cache
        store[torch.where(real, ctx.slots[0], ctx.slots[1]), torch.where(real, rows, rows - n)] = lat
        return torch.cat(self._attend_expanded(q, [lat], ctx))

    @staticmethod
    def _causal_softmax(scores: torch.Tensor, offset: int) -> torch.Tensor:
        """scores [H, n, N] fp32 for queries at positions offset..offset+n-1 over keys 0..N-1."""
        n, N = scores.shape[-2:]
        q_pos = torch.arange(offset, offset + n, device=scores.device)[:, None]
        visible = torch.arange(N, device=scores.device)[None, :] <= q_pos
        return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)

    # forward

    def _latent(self, kv_a: torch.Tensor) -> torch.Tensor:
        """kv_a [T, L + R] -> the latent [T, L + R]: the first L columns through kv_a_layernorm, then the
        RoPE columns as they are."""
        c = self.kv_a_layernorm(kv_a[:, : self.kv_lora_rank])
        return torch.cat([c, kv_a[:, self.kv_lora_rank :]], dim=-1)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank is not None:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.q_proj(x)

    def forward(
        self, x: torch.Tensor, ctx: ForwardContext, layer_cache: MLALayerCache | None
    ) -> torch.Tensor:
        """x [T, D] (the normed layer input) -> [T, D]; appends this step's latents to layer_cache."""
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"{self.prefix}: expected x [T, {self.hidden_size}], got {tuple(x.shape)}")
        T, H = x.shape[0], self.local_heads
        # the query beside the latent's chain (column-parallel: no collective on the side stream)
        q_branch = Branch(lambda: self._query(x), x)
        kv_a = self.kv_a_proj_with_mqa(x)  # [T, L + R]
        latent = None if ctx.is_static else self._latent(kv_a)  # a static step stores its own
        q = q_branch.result().reshape(T, H, self.qk_head_dim)
        if latent is None:
            o = self._attend_static(q, kv_a, ctx, layer_cache)  # [T, H, d_v]
        elif ctx.padded_prefill:
            o = self._attend_padded_prefill(q, latent, ctx, layer_cache)
        else:
            lats = self._sequence_latents(latent, ctx, layer_cache)
            absorbed = self.absorb == "always" or (self.absorb == "decode" and ctx.is_decode)
            attend = self._attend_absorbed if absorbed else self._attend_expanded
            o = torch.cat(attend(q, lats, ctx))  # [T, H, d_v] fp32
        if self.use_output_gate:
            o = o * torch.sigmoid(self.g_proj(x).float().reshape(T, H, self.v_head_dim))
        return self.o_proj(o.to(x.dtype).reshape(T, H * self.v_head_dim))

    def extra_repr(self) -> str:
        q = f"q_lora_rank={self.q_lora_rank}" if self.q_lora_rank is not None else "plain q_proj"
        return (
            f"heads={self.local_heads}/{self.num_heads}, {q}, kv_lora_rank={self.kv_lora_rank}, "
            f"qk={self.qk_nope_head_dim}+{self.qk_rope_head_dim}, v={self.v_head_dim}, "
            f"output_gate={self.use_output_gate}, absorb={self.absorb}"
        )
