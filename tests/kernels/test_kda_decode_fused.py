"""KDA's one-launch decode step (kernels/kda/decode.py) against the fp32 torch reference
(`kda_decode_fused_ref`: the conv, recurrence and gated norm references in a row), on odd sizes: 3 heads of
dim 24 (the kernel's 32-wide blocks masked), 5 sequences in 7 slots, two of them fresh in slots holding NaN
(which must not be read), q | k | v, b and the gate as column slices of wider rows, both gate forms (Kimi
Linear's softplus decay, K3's sigmoid with a lower bound).

Error bound: both sides run the same fp32 operations; they differ in the order of the K-term sums (the L2
norms, k^T S, q^T S, the output's mean square) and in FMA contraction, each a few fp32 roundings (relative
RMS <= 1e-5 at K = 24). Both keep the conv's output in fp32; with bf16 inputs the output alone is rounded,
once, to bf16, and the two roundings differ by at most one bf16 ulp (<= 2^-7 relative; the interpreter
rounds toward zero where the GPU and torch round to nearest). The windows are copies of inputs: exact.
Slots outside the batch: untouched.
"""

from __future__ import annotations

import pytest
import torch

from k3run.kernels.kda.ref import kda_decode_fused_ref
from k3run.testing import assert_close
from tests.interpreter_utils import interp_only, run_interp_tests_in_child

RTOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7}
H, K, W, S = 3, 24, 4, 7


def _case(dtype: torch.dtype, device: str, lower_bound: float | None, B: int = 5, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    P = H * K

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    wide = rnd(B, 3 * P + 2 * H + 9).to(dtype)  # q | k | v, then b among other columns
    slots = torch.tensor([4, 0, 6, 2, 5][:B], device=device)
    ctx = torch.tensor([3, 0, 9, 1, 0][:B], device=device)  # rows 1 and 4 fresh, in slots 0 and 5
    conv_pool = rnd(S, 3 * P, W - 1).to(dtype)
    state_pool = rnd(S, H, K, K, scale=0.3)
    conv_pool[[0, 5]] = float("nan")  # a fresh row's stale slot is never read
    state_pool[[0, 5]] = float("nan")
    gate_wide = rnd(B, P + 5).to(dtype)
    return dict(
        qkv=wide[:, : 3 * P], b=wide[:, 3 * P + 3 : 3 * P + 3 + H], f=rnd(B, P).to(dtype),
        gate=gate_wide[:, 5:], conv_weight=rnd(3 * P, W, scale=0.5), conv_pool=conv_pool,
        A_log=rnd(H, scale=0.5), dt_bias=rnd(P, scale=0.5), lower_bound=lower_bound, scale=K**-0.5,
        state_pool=state_pool, slots=slots, context_lens=ctx, norm_weight=rnd(K).abs() + 0.5, eps=1e-6,
    )  # fmt: skip


def _check(
    dtype: torch.dtype,
    device: str,
    lower_bound: float | None,
    B: int = 5,
    block_v: int = 8,
    flat: bool = False,
    num_warps: int = 4,
    persist: int = 0,
) -> None:
    from k3run.kernels.kda.decode import kda_decode_fused_triton

    case = _case(dtype, device, lower_bound, B)
    want_case = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    want = kda_decode_fused_ref(**want_case)
    conv_before, state_before = case["conv_pool"].clone(), case["state_pool"].clone()
    kw = dict(block_v=block_v, flat_shift=flat, num_warps=num_warps, persist=persist)
    got = kda_decode_fused_triton(**case, **kw)
    assert got.shape == want.shape == (B, H * K) and got.dtype == dtype
    assert_close("fused decode output", want.float(), got.float(), RTOL[dtype])
    used = case["slots"].tolist()
    other = [s for s in range(S) if s not in used]
    assert torch.equal(case["conv_pool"][used], want_case["conv_pool"][used]), "new windows must be exact"
    assert_close("new states", want_case["state_pool"][used], case["state_pool"][used], RTOL[dtype])
    for name, before in (("conv_pool", conv_before), ("state_pool", state_before)):  # NaN rows included
        same = torch.allclose(case[name][other], before[other], rtol=0, atol=0, equal_nan=True)
        assert same, f"{name}: slots outside the batch must be untouched"


def test_triton_kernels_in_interpreter() -> None:
    run_interp_tests_in_child(__file__, expected_passed=21)


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("block_v", [8, 32])
@pytest.mark.parametrize("flat", [False, True])
def test_interp_fused_decode_equals_the_reference(
    dtype: torch.dtype, lower_bound: float | None, block_v: int, flat: bool
) -> None:
    """block_v 8: a head's 24 value columns over 3 programs (the last normalises the row and shifts the q / k
    windows); 32: one program a head."""
    _check(dtype, "cpu", lower_bound, block_v=block_v, flat=flat)


@interp_only
@pytest.mark.parametrize("block_v, persist", [(8, 2), (8, 7), (32, 2), (32, 64)])
def test_interp_persistent_programs_equal_the_reference(block_v: int, persist: int) -> None:
    """persist N: N programs (the interpreter's SM count is 1) walk the 15 or 45 items (sequence, head, value
    block), each loading the next item's state before this one's work: 2 and 7 programs take several items
    each (7 leaves some one item fewer), 64 more programs than items (one item each, the grid cut to the item
    count). Fresh sequences' NaN slots stay unread, with the state read one item early."""
    _check(torch.bfloat16, "cpu", -5.0, block_v=block_v, flat=True, persist=persist)


@interp_only
def test_interp_empty_batch_launches_nothing() -> None:
    from k3run.kernels.kda.decode import kda_decode_fused_triton

    case = _case(torch.float32, "cpu", None, B=0)
    state = case["state_pool"].clone()
    assert kda_decode_fused_triton(**case).shape == (0, H * K)
    assert torch.equal(case["state_pool"].nan_to_num(), state.nan_to_num())


def test_wrong_shapes_name_the_tensor() -> None:
    from k3run.kernels.kda.decode import kda_decode_fused_triton

    case = _case(torch.float32, "cpu", None)
    case["f"] = case["f"][:, :-1]
    with pytest.raises(ValueError, match=r"kda_decode_fused: f: expected shape \(5, 72\), got \(5, 71\)"):
        kda_decode_fused_triton(**case)
    case = _case(torch.float32, "cpu", None)
    case["state_pool"] = case["state_pool"].to(torch.bfloat16)
    with pytest.raises(ValueError, match="state_pool must be a contiguous"):
        kda_decode_fused_triton(**case)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("block_v", [8, 32])
@pytest.mark.parametrize("flat", [False, True])
def test_gpu_fused_decode_equals_the_reference(
    dtype: torch.dtype, lower_bound: float | None, batch: int, block_v: int, flat: bool
) -> None:
    _check(dtype, "cuda", lower_bound, batch, block_v, flat)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block_v, persist", [(32, 1), (32, 2), (64, 3)])
def test_gpu_persistent_programs_give_the_bits_of_one_program_an_item(block_v: int, persist: int) -> None:
    """Kimi Linear's widths (32 heads of 128, W = 4) at 40 sequences (8 of them fresh, in slots holding NaN):
    2560 to 5120 items, so each persistent program walks several (N an SM); each item's arithmetic is the
    same as with one program an item, so the output, the windows and the states are bit-equal to it."""
    from k3run.kernels.kda.decode import kda_decode_fused_triton

    g = torch.Generator().manual_seed(1)
    b_, h, k, w, slots_n = 40, 32, 128, 4, 48
    p = h * k

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).cuda()

    slots = torch.randperm(slots_n, generator=g)[:b_].cuda()
    ctx = torch.randint(1, 50, (b_,), generator=g).cuda()
    ctx[::5] = 0
    conv_pool, state_pool = rnd(slots_n, 3 * p, w - 1).bfloat16(), rnd(slots_n, h, k, k, scale=0.3)
    conv_pool[slots[::5]] = float("nan")
    state_pool[slots[::5]] = float("nan")
    case = dict(
        qkv=rnd(b_, 3 * p).bfloat16(), b=rnd(b_, h).bfloat16(), f=rnd(b_, p).bfloat16(),
        gate=rnd(b_, p).bfloat16(), conv_weight=rnd(3 * p, w, scale=0.5), A_log=rnd(h, scale=0.5),
        dt_bias=rnd(p, scale=0.5), lower_bound=None, scale=k**-0.5, slots=slots, context_lens=ctx,
        norm_weight=rnd(k).abs() + 0.5, eps=1e-6,
    )  # fmt: skip
    pools = {}
    for n in (0, persist):
        cp, sp = conv_pool.clone(), state_pool.clone()
        out = kda_decode_fused_triton(**case, conv_pool=cp, state_pool=sp, block_v=block_v, persist=n)
        pools[n] = (out, cp[slots], sp[slots])
    for name, one, walked in zip(("output", "windows", "states"), pools[0], pools[persist], strict=True):
        assert torch.equal(one, walked), f"{name}: persist {persist} differs from one program an item"
    assert torch.isfinite(pools[0][0]).all()


def test_the_layer_form_follows_the_pair_count_unless_the_knob_sets_it() -> None:
    """K3RUN_KDA_FUSED_FORM unset: 32 value columns a program below 1024 (sequence, head) pairs, 64 from
    there; set: that form at every size."""
    from k3run.knobs import override_knobs
    from k3run.layers.kda import WIDE_FORM_PAIRS, fused_form, fused_form_kwargs

    assert WIDE_FORM_PAIRS == 1024
    with override_knobs(kda_fused_form=None):
        assert [fused_form(b, h) for b, h in [(1, 32), (31, 32), (32, 32), (8, 96), (11, 96), (64, 16)]] == [
            "32/4/flat", "32/4/flat", "64/4/flat", "32/4/flat", "64/4/flat", "64/4/flat",
        ]  # fmt: skip
    with override_knobs(kda_fused_form="32/2"):
        assert {fused_form(b, 32) for b in (1, 32, 128)} == {"32/2"}
    assert fused_form_kwargs("32/4/flat/p2") == dict(block_v=32, num_warps=4, flat_shift=True, persist=2)
    assert fused_form_kwargs("64/8/p1") == dict(block_v=64, num_warps=8, flat_shift=False, persist=1)
    assert fused_form_kwargs("16/1") == dict(block_v=16, num_warps=1, flat_shift=False, persist=0)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "form", ["64/4/flat", "64/8/flat", "32/8/flat", "32/2/flat", "16/1", "32/4/flat/p2", "8/4/flat/p3"]
)
def test_gpu_every_launch_form_equals_the_reference(form: str) -> None:
    """K3RUN_KDA_FUSED_FORM spellings beside the other tests' 32/4/flat (value columns a program / warps
    [/flat][/pN]; 64/4/flat is the layer's launch from 1024 (sequence, head) pairs):
    the same numbers as the reference at 5 sequences, bf16, both gate forms."""
    from k3run.layers.kda import fused_form_kwargs

    kw = fused_form_kwargs(form)
    for lower_bound in (None, -5.0):
        _check(torch.bfloat16, "cuda", lower_bound, 5, kw["block_v"], kw["flat_shift"], kw["num_warps"])
