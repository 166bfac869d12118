from __future__ import annotations

import math

import pytest
import torch

from k3run.formats import E2M1_VALUES, e2m1_decode, e2m1_encode, pack_e2m1, unpack_e2m1

GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def brute_force_code(x: float) -> int:
    """Independent oracle: nearest grid magnitude, ties to the even code (even mantissa), saturating;
    sign bit from x < 0."""
    a = abs(x)
    dists = [abs(a - g) for g in GRID]
    best = min(dists)
    candidates = [i for i, d in enumerate(dists) if d == best]
    mag = candidates[0] if len(candidates) == 1 else next(i for i in candidates if i % 2 == 0)
    return mag | (8 if x < 0 else 0)


def test_value_table_is_the_e2m1_format():
    # E2M1: 1 sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal (0, 0.5)
    for code in range(16):
        sign = -1.0 if code & 8 else 1.0
        exp, man = (code >> 1) & 3, code & 1
        mag = man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1)
        assert E2M1_VALUES[code].item() == sign * mag
        assert math.copysign(1.0, E2M1_VALUES[code].item()) == sign  # code 8 is -0.0
    assert E2M1_VALUES.dtype == torch.float32
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(e2m1_decode(codes), E2M1_VALUES)


def test_encode_every_grid_value_both_signs():
    for i, g in enumerate(GRID):
        assert e2m1_encode(torch.tensor([g])).item() == i
        assert e2m1_encode(torch.tensor([-g])).item() == (i | 8 if g > 0 else 0)  # -0.0 is not < 0


@pytest.mark.parametrize(
    ("threshold", "below", "at", "above"),
    [
        (0.25, 0, 0, 1),  # tie between 0 (even) and 0.5 -> 0
        (0.75, 1, 2, 2),  # tie between 0.5 and 1 (even) -> 1
        (1.25, 2, 2, 3),  # tie between 1 (even) and 1.5 -> 1
        (1.75, 3, 4, 4),  # tie between 1.5 and 2 (even) -> 2
        (2.5, 4, 4, 5),  # tie between 2 (even) and 3 -> 2
        (3.5, 5, 6, 6),  # tie between 3 and 4 (even) -> 4
        (5.0, 6, 6, 7),  # tie between 4 (even) and 6 -> 4
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rounding_boundaries(threshold, below, at, above, dtype):
    t = torch.tensor(threshold, dtype=dtype)
    lo = torch.nextafter(t, torch.tensor(0.0, dtype=dtype))
    hi = torch.nextafter(t, torch.tensor(100.0, dtype=dtype))
    for v, want in ((lo, below), (t, at), (hi, above)):
        assert e2m1_encode(v.reshape(1)).item() == want, (dtype, v.item())
        assert e2m1_encode(-v.reshape(1)).item() == want | 8, (dtype, -v.item())
        assert brute_force_code(v.item()) == want  # the table above agrees with the oracle


def test_tiny_negatives_are_negative_zero_and_saturation():
    x = torch.tensor([-1e-30, -0.1, -0.25, 0.1, 1e-30, -0.0, 0.0, 7.0, -1e30, 1e30])
    got = e2m1_encode(x).tolist()
    assert got == [8, 8, 8, 0, 0, 0, 0, 7, 15, 7]
    assert math.copysign(1.0, e2m1_decode(torch.tensor([8], dtype=torch.uint8)).item()) == -1.0


def test_encode_matches_brute_force_on_dense_sweep():
    # every multiple of 1/64 in [-7, 7] plus random fp32 values: covers all ties and all intervals
    x = torch.cat([torch.arange(-7 * 64, 7 * 64 + 1) / 64.0, torch.randn(4000) * 3])
    want = torch.tensor([brute_force_code(v) for v in x.tolist()], dtype=torch.uint8)
    assert torch.equal(e2m1_encode(x), want)


def test_encode_keeps_shape_and_device_dtype():
    x = torch.randn(3, 5, 32, dtype=torch.bfloat16)
    codes = e2m1_encode(x)
    assert codes.shape == x.shape and codes.dtype == torch.uint8 and int(codes.max()) <= 15


def test_pack_layout_low_nibble_is_even_element():
    codes = torch.tensor([[1, 2, 15, 8, 0, 7]], dtype=torch.uint8)
    assert pack_e2m1(codes).tolist() == [[0x21, 0x8F, 0x70]]


def test_pack_unpack_round_trip():
    codes = torch.randint(0, 16, (4, 6, 64), dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.shape == (4, 6, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_e2m1(packed), codes)
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(2, 128)
    assert torch.equal(pack_e2m1(unpack_e2m1(every_byte)), every_byte)


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="finite.*got 1 NaN/Inf"):
        e2m1_encode(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="finite"):
        e2m1_encode(torch.tensor([float("inf")]))
    with pytest.raises(ValueError, match="expected dtype.*got torch.int64"):
        e2m1_encode(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="expected dtype torch.uint8, got torch.int32"):
        e2m1_decode(torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ValueError, match="0..15, got max 16"):
        e2m1_decode(torch.tensor([16], dtype=torch.uint8))
    with pytest.raises(ValueError, match="last dim must be even, got shape \\(2, 3\\)"):
        pack_e2m1(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="0..15, got max 200"):
        pack_e2m1(torch.tensor([200, 1], dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8, got torch.float32"):
        unpack_e2m1(torch.zeros(4))


def test_byte_table_decode_equals_unpack_then_decode():
    from k3run.formats.e2m1 import decode_e2m1_bytes

    packed = torch.arange(256, dtype=torch.uint8).reshape(4, 64)[:, torch.randperm(64)]
    assert torch.equal(decode_e2m1_bytes(packed), e2m1_decode(unpack_e2m1(packed)))
    with pytest.raises(ValueError, match="uint8"):
        decode_e2m1_bytes(packed.float())
