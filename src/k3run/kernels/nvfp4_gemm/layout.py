"""NVFP4 weight layouts, prepared once at load time: the checkpoint's bytes, split128 (the Triton kernels) and
tiled128 (the Gluon decode kernels, the wgmma and sm_90 CUDA GEMMs), with their exact inverses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

CHUNK = 128  # split128 layout: one 128-wide K chunk per 64 bytes (low nibbles k 0..63, high nibbles 64..127)
LAYOUTS = ("checkpoint", "split128", "tiled128")


def repack_split128(weight: torch.Tensor, weight_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint layout (uint8 [N, K/2], low nibble = even k; E4M3 [N, K/16]) -> kernel layout
    (uint8 [N, K_pad/2] split128 bytes, uint8 [N, K_pad/16] scale bits), K_pad = K rounded up to 128,
    zero-padded (a zero scale decodes the padding to 0)."""
    n, k = weight.shape[0], weight.shape[1] * 2
    k_pad = -(-k // CHUNK) * CHUNK
    codes = torch.stack([weight & 0xF, weight >> 4], dim=-1).reshape(n, k)  # [N, K] E2M1 codes
    codes = F.pad(codes, (0, k_pad - k)).reshape(n, k_pad // CHUNK, 2, CHUNK // 2)
    packed = (codes[:, :, 0] | (codes[:, :, 1] << 4)).reshape(n, k_pad // 2).contiguous()
    scale = F.pad(weight_scale.view(torch.uint8), (0, (k_pad - k) // 16)).contiguous()
    return packed, scale


# The tiled128 word: the 8 nibbles of 4 split128 bytes b0..b3 (n0..n3 = the low nibbles of b0..b3, n4..n7 the
# high ones) form 4 output pairs of the decode kernel: pair j = (n[2j], n[2j+1]) -> the low and high 16-bit
# half of one mma operand register. TILED_PAIR_BITS[j] = (sign bit, lowest magnitude bit) of n[2j] in the
# stored word; n[2j+1] sits 16 bits higher. The decoder (gluon_gemv.tiled_word_decode_asm) moves each sign
# to bit 15 and each 3-bit magnitude to bits 8..6 (bf16) or 11..9 (fp16) of its half: pair 0 is in place for
# bf16 (one AND), pair 1 needs one shift for both (sign - magnitude = 9 as in bf16), pairs 2 and 3 two shifts.
# No placement does better: 4 pairs with the bf16 spacing cannot tile the 16 bits of a half (checked by
# enumeration, bench/NOTES.md "v6").
TILED_PAIR_BITS = ((15, 6), (9, 0), (10, 3), (11, 12))
# The 8 scale bytes of a row's 128-wide chunk (groups 0..3 of the low nibbles, 4..7 of the high ones) are
# stored in the order TILED_SCALE_ORDER: the decode kernel's lane for groups {g, g + 2} (g = 0 or 1) reads one
# 32-bit word at byte 4g, (low g, high g, low g + 2, high g + 2): two cvt.f16x2.e4m3x2 operands as they are.
TILED_SCALE_ORDER = (0, 4, 2, 6, 1, 5, 3, 7)


def tiled_word(b: list[int]) -> int:
    """The stored tiled128 word of split128 bytes b[0..3] (one word of tile_split128's packing)."""
    return int(_pack_words(torch.tensor(b, dtype=torch.uint8)))


def _pack_words(b: torch.Tensor) -> torch.Tensor:
    """split128 bytes [..., 4] (uint8) -> stored tiled128 words [...] (int64 holding 32 bits)."""
    b = b.to(torch.int64)
    out = torch.zeros(b.shape[:-1], dtype=torch.int64, device=b.device)
    for j, (xs, ys) in enumerate(TILED_PAIR_BITS):
        for h in range(2):
            nib = (b[..., (2 * j + h) % 4] >> (4 * (j >= 2))) & 0xF
            out |= (nib >> 3) << (xs + 16 * h) | (nib & 7) << (ys + 16 * h)
    return out


def _unpack_words(q: torch.Tensor) -> torch.Tensor:
    """Inverse of _pack_words: words [...] (int64) -> split128 bytes [..., 4] (uint8)."""
    nib = []
    for xs, ys in TILED_PAIR_BITS:
        for h in range(2):
            nib.append(((q >> (xs + 16 * h)) & 1) << 3 | ((q >> (ys + 16 * h)) & 7))
    # n[2j + h]: bytes b_i = n_i | n_{4 + i} << 4
    return torch.stack([nib[i] | nib[4 + i] << 4 for i in range(4)], dim=-1).to(torch.uint8)


def check_scale_bytes(scale_u8: torch.Tensor, what: str = "weight_scale") -> None:
    """NVFP4 block scales are finite, non-negative E4M3 (what the format and ModelOpt write): the tiled128
    decoder builds the scale's bits by an exponent add that a sign bit or NaN would corrupt."""
    b = scale_u8.view(torch.uint8)
    bad = ((b & 0x80) != 0) & (b != 0x80) | ((b & 0x7F) == 0x7F)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"nvfp4 {what}: expected finite E4M3 scales >= 0, found {int(bad.sum())} negative or NaN "
            f"(first at {idx}: byte 0x{int(b[idx]):02x})"
        )


def tile_split128(weight: torch.Tensor, scale_u8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """split128 bytes [N, K_pad/2] and scale bytes [N, K_pad/16] -> the tiled128 layout: rows padded with
    zeros to a multiple of 16, then [N_pad/16, K_pad/128, 16, 64] bytes and [.., 16, 8] scales (in
    TILED_SCALE_ORDER), returned as [N_pad, K_pad/2] and [N_pad, K_pad/16] tensors. A 1-warp program's K
    tiles are consecutive 1 KB blocks (split128 rows are 64-byte pieces K_pad/2 bytes apart), and each 4-byte
    word's 32 bits are placed for the shift decoder (TILED_PAIR_BITS). The codes of groups whose scale is 0
    are stored as 0 (their weights are 0 either way; the decoder's scale, built by an exponent add, is not 0
    there). Scales must be finite and >= 0 (check_scale_bytes)."""
    check_scale_bytes(scale_u8)
    n, half = weight.shape
    n_pad = -(-n // 16) * 16
    ch = half // 64
    w = torch.zeros((n_pad, half), dtype=torch.uint8, device=weight.device)
    s = torch.zeros((n_pad, half // 8), dtype=torch.uint8, device=weight.device)
    w[:n], s[:n] = weight, scale_u8
    zero = (s.view(torch.float8_e4m3fn).float() == 0).view(n_pad, ch, 2, 4, 1)  # [.., low/high, group, 1]
    keep = (~zero[:, :, 0]).to(torch.uint8) * 0x0F | (~zero[:, :, 1]).to(torch.uint8) * 0xF0
    w = (w.view(n_pad, ch, 4, 16) & keep).view(n_pad, half // 4, 4)
    words = _pack_words(w).to(torch.int32)  # the low 32 bits (int64 -> int32 wraps)
    w = words.view(torch.uint8).view(n_pad, half)  # little-endian bytes of each word
    w = w.reshape(n_pad // 16, 16, ch, 64).transpose(1, 2).contiguous().view(n_pad, half)
    s = s.view(n_pad, ch, 8)[:, :, list(TILED_SCALE_ORDER)]
    s = s.reshape(n_pad // 16, 16, ch, 8).transpose(1, 2).contiguous().view(n_pad, half // 8)
    return w, s


def untile_split128(
    weight: torch.Tensor, scale_u8: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of tile_split128: the first n rows back in split128 order."""
    n_pad, half = weight.shape
    ch = half // 64
    w = weight.view(n_pad // 16, ch, 16, 64).transpose(1, 2).reshape(n_pad, half).contiguous()
    q = w.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    w = _unpack_words(q).reshape(n_pad, half)
    s = scale_u8.view(n_pad // 16, ch, 16, 8).transpose(1, 2).reshape(n_pad, ch, 8)
    inverse = [TILED_SCALE_ORDER.index(g) for g in range(8)]
    s = s[:, :, inverse].reshape(n_pad, half // 8)
    return w[:n].contiguous(), s[:n].contiguous()


def unpack_split128(
    packed: torch.Tensor, scale_bits: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of repack_split128: back to (uint8 [N, K/2], float8_e4m3fn [N, K/16])."""
    n, k_pad = packed.shape[0], packed.shape[1] * 2
    halves = torch.stack([packed & 0xF, packed >> 4], dim=1)  # [N, 2, K_pad/2]: half, (chunk, j)
    codes = halves.reshape(n, 2, k_pad // CHUNK, CHUNK // 2).permute(0, 2, 1, 3).reshape(n, k_pad)[:, :k]
    weight = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    return weight, scale_bits[:, : k // 16].contiguous().view(torch.float8_e4m3fn)


@dataclass(frozen=True)
class NvFp4Weight:
    """An NVFP4 weight in the layout its kernel reads.

    layout "checkpoint": weight uint8 [N, K/2] (low nibble = even k), scale_bits uint8 [N, K/16].
    layout "split128":   weight uint8 [N, K_pad/2], scale_bits uint8 [N, K_pad/16] (see repack_split128).
    layout "tiled128":   split128 stored tile by tile (tile_split128): [N_pad, K_pad/2] / [N_pad, K_pad/16]
                         with N_pad = N rounded up to 16 (zero rows); `rows` holds N; a per-row global_scale
                         is padded to N_pad with ones. Read by the cp.async decode kernel (up to 32 rows a
                         launch), the tile and wgmma GEMMs and the dequantize kernel.
    scale_bits are the E4M3 group scales as raw bytes (Triton loads fp8 through uint8).
    global_scale: fp32 [1] (per tensor) or [N] (fused shards with their own global scales), decode scale.
    """

    weight: torch.Tensor
    scale_bits: torch.Tensor
    global_scale: torch.Tensor
    k: int
    layout: str
    rows: int = -1  # the real N when the layout pads rows (tiled128)
    cpu_int8: Any = None  # checkpoint layout on the CPU: a cpu_simd.Vnni16Weight copy (K3RUN_CPU_INT8=1)

    @property
    def n(self) -> int:
        return self.rows if self.rows >= 0 else self.weight.shape[0]

    @property
    def row_global_scale(self) -> torch.Tensor:
        """global_scale without the layout's row padding: [1] or [N]."""
        gs = self.global_scale
        return gs if gs.numel() == 1 else gs[: self.n]

    def checkpoint_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(uint8 [N, K/2], float8_e4m3fn [N, K/16]) in the checkpoint layout."""
        if self.layout == "tiled128":
            return unpack_split128(*untile_split128(self.weight, self.scale_bits, self.n), self.k)
        if self.layout == "split128":
            return unpack_split128(self.weight, self.scale_bits, self.k)
        return self.weight, self.scale_bits.view(torch.float8_e4m3fn)


def prepare_nvfp4_weight(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    layout: str | None = None,
) -> NvFp4Weight:
    """Check the checkpoint tensors once and return the kernel layout.

    weight_scale_2 may be 0-dim/one element (per tensor) or [N] (one decode scale per output row).
    layout None: "tiled128" for CUDA tensors on sm_89+ with the Gluon decode kernel available, "split128" on
    other CUDA devices (the Triton kernels), "checkpoint" otherwise (the reference).
    """
    if weight.dtype != torch.uint8 or weight.dim() != 2:
        raise ValueError(f"nvfp4 weight: expected uint8 [N, K/2], got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape[0], weight.shape[1] * 2
    if k % 16:
        raise ValueError(f"nvfp4 weight: K={k} must be a multiple of 16")
    if weight_scale.dtype != torch.float8_e4m3fn or tuple(weight_scale.shape) != (n, k // 16):
        raise ValueError(
            f"nvfp4 weight_scale: expected float8_e4m3fn {(n, k // 16)}, "
            f"got {weight_scale.dtype} {tuple(weight_scale.shape)}"
        )
    if weight_scale_2.dtype != torch.float32 or weight_scale_2.numel() not in (1, n):
        raise ValueError(
            f"nvfp4 weight_scale_2: expected fp32 with 1 or {n} elements, "
            f"got {weight_scale_2.dtype} {tuple(weight_scale_2.shape)}"
        )
    layout = layout or (default_cuda_layout(weight.device) if weight.is_cuda else "checkpoint")
    if layout not in LAYOUTS:
        raise ValueError(f"nvfp4 layout: expected one of {LAYOUTS}, got {layout!r}")
    gs = weight_scale_2.reshape(-1).contiguous()
    rows = -1
    if layout in ("split128", "tiled128"):
        w, s = repack_split128(weight, weight_scale)
        if layout == "tiled128":
            w, s = tile_split128(w, s)
            rows = n
            if gs.numel() > 1 and w.shape[0] > n:
                gs = torch.cat([gs, gs.new_ones(w.shape[0] - n)])
    else:
        w, s = weight.contiguous(), weight_scale.contiguous().view(torch.uint8)
    cpu_int8 = None
    if layout == "checkpoint" and not weight.is_cuda:
        from k3run.kernels import cpu_simd

        if cpu_simd.int8_activations_enabled() and cpu_simd.vnni_available():
            cpu_int8 = cpu_simd.nvfp4_vnni_pack(weight, weight_scale, gs)
    return NvFp4Weight(w, s, gs, k, layout, rows, cpu_int8)


def default_cuda_layout(device: torch.device) -> str:
    """tiled128 where its decode kernel runs (Gluon, sm_89+: the decoder converts E4M3 scales with
    cvt.f16x2.e4m3x2), split128 elsewhere (the Triton kernels)."""
    from . import gemv_available

    if gemv_available() and torch.cuda.get_device_capability(device) >= (8, 9):
        return "tiled128"
    return "split128"


def nvfp4_to_fp8_block(
    weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Load-time conversion for the optional FP8 tensor-core path (`--nvfp4-as-fp8`; opt-in, lossy).

    Dequantizes the NVFP4 weight exactly in fp32 and re-quantizes it to 128x128-block E4M3, returning
    (fp8 [N_pad, K] with zero pad rows, fp32 scale [N_pad/128, K/128]) ready for fp8_gemm.fp8_pb_wo_linear.
    E4M3 keeps 4 significant bits where e2m1 * e4m3 needs up to 6, so this adds a rounding error (measured
    in bench/bench_linear.py); K must be a multiple of 128.
    """
    from k3run.formats import dequantize_nvfp4, quantize_fp8_block

    w = dequantize_nvfp4(weight, weight_scale, 1.0) * weight_scale_2.float().reshape(-1, 1)
    n, k = w.shape
    if k % 128:
        raise ValueError(f"nvfp4_to_fp8_block: K={k} must be a multiple of 128 for FP8 block GEMMs")
    q, scale = quantize_fp8_block(w)
    n_pad = scale.shape[0] * 128
    q_pad = torch.zeros((n_pad, k), dtype=torch.float8_e4m3fn, device=w.device)
    q_pad[:n] = q
    return q_pad, scale.reshape(scale.shape[0], scale.shape[2]).contiguous()
