from __future__ import annotations

import pytest
import torch

from k3run.formats import (
    dequantize_mxfp4,
    dequantize_nvfp4,
    e2m1_decode,
    e2m1_encode,
    e8m0_to_float,
    mxfp4_k_max,
    mxfp4_to_nvfp4,
    pack_e2m1,
    unpack_e2m1,
)
from k3run.testing import rel_rms_error


def random_mxfp4(n: int, k: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.int32).to(torch.uint8)
    scale = torch.randint(lo, hi + 1, (n, k // 32), dtype=torch.int32).to(torch.uint8)
    return packed, scale


def test_e8m0_values_exact():
    e = torch.tensor([0, 1, 100, 127, 128, 254], dtype=torch.uint8)
    want = [2.0**-127, 2.0**-126, 2.0**-27, 1.0, 2.0, 2.0**127]
    assert e8m0_to_float(e).tolist() == want


def test_dequantize_by_hand():
    codes = torch.zeros(1, 32, dtype=torch.uint8)
    codes[0, 0], codes[0, 1], codes[0, 31] = 7, 9, 4  # 6, -0.5, 2
    scale = torch.tensor([[125]], dtype=torch.uint8)  # 2^-2
    out = dequantize_mxfp4(pack_e2m1(codes), scale)
    assert out.shape == (1, 32)
    assert out[0, :2].tolist() == [1.5, -0.125] and out[0, 31].item() == 0.5
    assert torch.all(out[0, 2:31] == 0)


def test_transcode_is_lossless_in_range():
    packed, scale = random_mxfp4(24, 128, 110, 127)  # exponent gap <= 17
    t = mxfp4_to_nvfp4(packed, scale)
    assert torch.equal(t.weight, packed)  # codes untouched
    assert t.weight.dtype == torch.uint8 and t.weight.shape == (24, 64)
    assert t.weight_scale.dtype == torch.float8_e4m3fn and t.weight_scale.shape == (24, 8)
    assert t.weight_scale_2.dtype == torch.float32 and t.weight_scale_2.shape == ()
    k_max = int(scale.max()) - 127
    assert t.weight_scale_2.item() == 2.0 ** (k_max - 8)
    # both 16-halves of a 32-block carry 2^(k_j - k_max + 8), a power of two in [2^-9, 2^8]
    want = torch.exp2(scale.float() - 127 - (k_max - 8)).repeat_interleave(2, dim=-1)
    assert torch.equal(t.weight_scale.float(), want)
    assert torch.equal(dequantize_nvfp4(*t), dequantize_mxfp4(packed, scale))


def test_shared_k_max_for_w1_w3():
    w1, s1 = random_mxfp4(8, 64, 115, 120)
    w3, s3 = random_mxfp4(8, 64, 118, 126)
    k_max = max(mxfp4_k_max(s1), mxfp4_k_max(s3))
    t1, t3 = mxfp4_to_nvfp4(w1, s1, k_max), mxfp4_to_nvfp4(w3, s3, k_max)
    assert torch.equal(t1.weight_scale_2, t3.weight_scale_2)
    assert t1.weight_scale_2.item() == 2.0 ** (k_max - 8)
    assert torch.equal(dequantize_nvfp4(*t1), dequantize_mxfp4(w1, s1))
    assert torch.equal(dequantize_nvfp4(*t3), dequantize_mxfp4(w3, s3))


# every value NVFP4 can hold relative to its global scale: E2M1 magnitude u times an E4M3 power of two 2^s
_NVFP4_GRID = torch.tensor(
    [u * 2.0**s for u in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0) for s in range(-9, 9)], dtype=torch.float64
)


def _nvfp4_can_hold(v: torch.Tensor, k: torch.Tensor, m: int) -> torch.Tensor:
    """Brute force over the grid: is |v| * 2^k (float64, exact here) some u * 2^s * 2^m? An oracle independent
    of the cast's own rule, for uniform blocks (all 32 values equal). v [C, 1], k [1, E] -> bool [C, E]."""
    return torch.isin(v.abs() * torch.pow(2.0, k - m), _NVFP4_GRID)


def test_every_e8m0_exponent_and_code_is_exact_or_refused():
    """For each largest exponent the tensor can have (E8M0 0..254) and each block exponent at or below it,
    each code: the cast is bitwise exact where NVFP4 (E4M3 block scale x fp32 global scale) can hold the
    value, and refused where it cannot or where the value overflows fp32."""
    codes_per_row = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 15], dtype=torch.uint8)  # +0..6 and -6
    vals = e2m1_decode(codes_per_row).double()[:, None]
    refused = 0
    for top in range(255):
        k_max = top - 127
        m = max(k_max - 8, -126)
        k = torch.arange(top + 1, dtype=torch.float64)[None, :] - 127
        ok = _nvfp4_can_hold(vals, k, m) & (vals.abs() * torch.pow(2.0, k) < 2.0**128)
        scale = torch.arange(top + 1, dtype=torch.uint8).expand(len(vals), -1).contiguous()  # [9, top + 1]
        codes = codes_per_row[:, None, None].expand(-1, top + 1, 32)
        kept = torch.where(ok[:, :, None], codes, 0).reshape(len(vals), -1)
        packed = pack_e2m1(kept)
        t = mxfp4_to_nvfp4(packed, scale)
        assert t.weight_scale_2.item() == 2.0**m
        # bitwise equal (torch.equal: same values, and -0 / +0 and inf agree as floats)
        assert torch.equal(dequantize_nvfp4(*t), dequantize_mxfp4(packed, scale)), top
        bad = (~ok).nonzero()
        if len(bad):
            c, e = (int(i) for i in bad[len(bad) // 2])
            one = kept.reshape(len(vals), top + 1, 32).clone()
            one[c, e] = codes_per_row[c]
            with pytest.raises(ValueError, match=rf"row {c}, 32-block {e}: MXFP4 value"):
                mxfp4_to_nvfp4(pack_e2m1(one.reshape(len(vals), -1)), scale)
            refused += 1
    # the exact cases are most of them: gaps up to 17 binades for every code, and zero at any gap
    assert refused == 255 - 18


def test_blocks_far_below_the_largest_are_exact_when_their_codes_allow():
    packed, scale = random_mxfp4(6, 96, 120, 127)
    codes = unpack_e2m1(packed)
    scale[0, 0] = 0  # 2^-127, 134 binades below k_max: an all-zero block (how such blocks arise)
    codes[0, 0:32] = 0
    scale[1, 2] = 127 + 7 - 18  # one binade below 2^-9 * weight_scale_2: values 2, 4, 6 move to 1, 2, 3
    codes[1, 64:96] = torch.tensor([4, 6, 7, 12, 14, 15, 0, 8] * 4)  # the rewrite writes -0 as +0
    scale[2, 1] = 127 + 7 - 17  # gap 17: exact with the codes as they are (block scale 2^-9)
    scale[3, 0] = 134
    packed = pack_e2m1(codes)
    t = mxfp4_to_nvfp4(packed, scale)
    assert torch.equal(dequantize_nvfp4(*t), dequantize_mxfp4(packed, scale))
    assert t.weight_scale[2, 2].float().item() == 2.0**-9 and t.weight_scale[1, 4].float().item() == 2.0**-9
    assert torch.equal(
        unpack_e2m1(t.weight)[1, 64:72], torch.tensor([2, 4, 5, 10, 12, 13, 0, 0], dtype=torch.uint8)
    )
    # only the rewritten block's codes change
    same = torch.ones(6, 96, dtype=torch.bool)
    same[1, 64:96] = False
    assert torch.equal(unpack_e2m1(t.weight)[same], codes[same])
    # a 1.5 there would need 0.75: refused, naming the block
    codes[1, 70] = 3
    with pytest.raises(
        ValueError, match=r"row 1, 32-block 2: MXFP4 value 1.5 \* 2\^-11 sits 1 binades below"
    ):
        mxfp4_to_nvfp4(pack_e2m1(codes), scale)


def test_requantized_gaussian_round_trip():
    # the standard use: MXFP4 of a real-ish weight, transcode, dequantize equals MXFP4's dequantization
    w = torch.randn(16, 64)
    blocks = w.reshape(16, 2, 32)
    e = torch.floor(torch.log2(blocks.abs().amax(-1) / 6)).clamp(-127, 127) + 1  # scale so |x|/2^e <= 6
    codes = e2m1_encode((blocks / torch.exp2(e).unsqueeze(-1)).reshape(16, 64))
    scale = (e + 127).to(torch.uint8)
    packed = pack_e2m1(codes)
    t = mxfp4_to_nvfp4(packed, scale)
    assert torch.equal(dequantize_nvfp4(*t), dequantize_mxfp4(packed, scale))
    assert rel_rms_error(w, dequantize_mxfp4(packed, scale)) < 0.2


def test_bad_inputs():
    packed, scale = random_mxfp4(4, 64, 120, 127)
    scale[0, 0] = 127
    with pytest.raises(ValueError, match="scale_e8m0: expected shape \\(4, 2\\), got \\(4, 1\\)"):
        dequantize_mxfp4(packed, scale[:, :1])
    with pytest.raises(ValueError, match="packed width K/2 must be a multiple of 16, got 12"):
        mxfp4_to_nvfp4(packed[:, :12], scale)
    with pytest.raises(ValueError, match="packed: expected dtype torch.uint8, got torch.int8"):
        dequantize_mxfp4(packed.to(torch.int8), scale)
    bad = scale.clone()
    bad[0, 0] = 255
    with pytest.raises(ValueError, match="got 255 \\(the E8M0 NaN encoding\\)"):
        dequantize_mxfp4(packed, bad)
    with pytest.raises(ValueError, match="got 255"):
        mxfp4_to_nvfp4(packed, bad, k_max=200)
    with pytest.raises(ValueError, match="k_max: expected >= the tensor's largest exponent 0, got -1"):
        mxfp4_to_nvfp4(packed, scale, k_max=-1)
    with pytest.raises(ValueError, match="expected 2 dims \\[N, K/2\\]"):
        mxfp4_to_nvfp4(packed.reshape(2, 2, 32), scale.reshape(2, 2, 2))
