"""kernels/moe_ops (router logits GEMV, sigmoid top-k, gated activation, top-k combine) against their fp32
torch references (ref.py), on random odd sizes.

Error bounds, elementwise, from counted fp32 roundings (u = 2^-24 each, first order):
- router logits, row length D: both sides sum D products in fp32 in different orders, each within
  (D + 1) u sum_j |x_j w_j| of the exact dot product, so within 2 (D + 1) u S of each other (S = sum |x w|).
- sigmoid top-k: the scores are the same operations as torch's (1 / (1 + exp(-x)), IEEE division); exp may
  differ by 2 u between libdevice and torch's CUDA build or the interpreter's numpy, which moves a score by
  <= (|x| + 4) u. The picked experts must be the reference's (random fp32 choices do not tie; that is
  checked), the weights within the renormalisation's A additions and one division: (A + 2 |x| + 10) u |w|.
- gated: silu(g) u or SiTU, 4-8 roundings, exp and tanh (2 u each) of arguments near |g|, |u| / beta:
  (2 |g| + 16) u |h| covers both sides; 16-bit outputs add one output ulp.
- combine: A products and A - 1 additions in fp32 on each side: 2 (A + 1) u sum_k |w_k y_k|.
The interpreter mishandles bf16 math (toolchain notes), so its tests run fp32 and fp16 inputs; the GPU tests
run bf16 as the model does.
"""

from __future__ import annotations

import pytest
import torch

from k3run.kernels.moe_ops import combine_ref, gated_ref, router_logits_ref, sigmoid_topk_ref
from k3run.testing import FP32_U, assert_within, output_ulp
from tests.interpreter_utils import interp_only, run_interp_tests_in_child

U = FP32_U
needs_cuda = pytest.mark.gpu  # selected by `pytest -m gpu`; tests/conftest.py skips it without CUDA


def _logits_case(t: int, e: int, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g) * 3
    bias = torch.randn(e, generator=g) * 0.5
    return logits.to(device), bias.to(device)


def check_topk(
    t: int, e: int, a: int, renorm: bool, scale: float, device: str, extra: int | None = None
) -> None:
    from k3run.kernels.moe_ops.triton import sigmoid_topk_triton

    logits, bias = _logits_case(t, e, t * 131 + e, device)
    ref_w, ref_ids = sigmoid_topk_ref(logits.cpu().double(), bias.cpu().double(), a, renorm, scale, extra)
    choice = torch.sigmoid(logits.cpu().double()) + bias.cpu().double()
    top = choice.topk(min(e, a + 1), dim=-1).values
    assert (top[:, :-1] - top[:, 1:]).min() > 1e-5, "the random choices tie: pick another seed"
    w, ids = sigmoid_topk_triton(logits, bias, a, renorm, scale, extra)
    cols = a + (extra is not None)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == w.shape == (t, cols)
    assert torch.equal(ids.cpu(), ref_ids), "picked experts differ from torch.topk's"
    if extra is not None:  # the appended column: that expert at weight exactly 1, the picks unchanged
        assert (ids[:, a] == extra).all() and (w[:, a] == 1).all()
        w_plain, ids_plain = sigmoid_topk_triton(logits, bias, a, renorm, scale)
        assert torch.equal(ids[:, :a], ids_plain) and torch.equal(w[:, :a], w_plain)
    bound = (a + 2 * logits.abs().max().cpu().double() + 10) * U * ref_w.abs()
    assert_within("sigmoid_topk weights", ref_w.float(), w.cpu(), bound.float())


def check_topk_ties_and_nan(device: str) -> None:
    """Equal choices go to the lower expert index; a NaN logit never makes a pick repeat or leave [0, E)."""
    from k3run.kernels.moe_ops.triton import sigmoid_topk_triton

    logits = torch.zeros(3, 37, device=device)
    bias = torch.zeros(37, device=device)
    logits[1, 5] = float("nan")
    logits[2] = float("nan")
    w, ids = sigmoid_topk_triton(logits, bias, 8, True, 1.0)
    assert ids[0].tolist() == list(range(8))
    for row in ids.cpu():
        assert len(set(row.tolist())) == 8 and 0 <= int(row.min()) and int(row.max()) < 37
    assert torch.allclose(w[0].cpu(), torch.full((8,), 1 / 8))


def check_logits(t: int, e: int, d: int, dtype: torch.dtype, device: str, dot: bool = False) -> None:
    """The logits against fp64. The dot form's (bf16 x) on the GPU sum on the tensor cores, whose fp32
    accumulation may truncate instead of rounding to nearest: 2 u an addition, so its bound is twice the
    broadcast form's. (That its weight parts add up to the fp32 weight exactly is check_dot_exact's test:
    a random sum would hide a lost part.)"""
    from k3run.kernels.moe_ops.triton import router_logits_triton

    g = torch.Generator().manual_seed(t + e + d)
    x = torch.randn(t, d, generator=g).to(dtype)
    w = torch.randn(e, d, generator=g) / d**0.5
    ref = router_logits_ref(x.double(), w.double())
    out = router_logits_triton(x.to(device), w.to(device), dot)
    s = x.double().abs() @ w.double().abs().t()
    ulps = 4 if dot and device != "cpu" else 2
    assert_within("router logits", ref.float(), out.cpu(), (ulps * (d + 1) * U * s).float())


def check_dot_exact(t: int, e: int, d: int, device: str) -> None:
    """The dot form on one-hot rows of x (token i: a power of two at column c_i, zeros elsewhere) returns
    x[i, c_i] * W[:, c_i], bit for bit: every other product is an exact 0 and the three bf16 parts of each
    weight add up to it exactly. Weights with all 24 significant bits set, so a part lost, or a part
    rounded, shows."""
    from k3run.kernels.moe_ops.triton import router_logits_triton

    g = torch.Generator().manual_seed(t * 3 + e + d)
    scale = 2.0 ** torch.randint(-9, 3, (e, d), generator=g)
    w = (1 + torch.rand(e, d, generator=g, dtype=torch.float64)) * scale
    w = torch.where(torch.rand(e, d, generator=g) < 0.5, -w, w).float()
    w = (w.view(torch.int32) | 0x7FFF).view(torch.float32)  # the low 15 significand bits all 1
    cols = torch.randint(0, d, (t,), generator=g)
    vals = 2.0 ** torch.randint(-3, 4, (t,), generator=g).double()
    x = torch.zeros(t, d, dtype=torch.bfloat16)
    x[torch.arange(t), cols] = vals.to(torch.bfloat16)
    out = router_logits_triton(x.to(device), w.to(device), dot=True).cpu()
    want = (w[:, cols].t().double() * vals[:, None]).float()
    assert torch.equal(out, want), f"{int((out != want).sum())} of {out.numel()} logits not exact"


def check_router(t: int, e: int, d: int, a: int, device: str, dot: bool = False) -> None:
    """The two-launch router: the top-k kernel summing the partial logits in block order picks what the
    reference picks on the same logits (router_logits_triton sums them in that order), weights in bound.
    `dot`: the partials of the dot form (bf16 x)."""
    from k3run.kernels.moe_ops.triton import router_logits_triton, router_partials, sigmoid_topk_triton

    g = torch.Generator().manual_seed(t * e + d)
    x = torch.randn(t, d, generator=g).to(torch.bfloat16 if dot else torch.float16).to(device)
    w = (torch.randn(e, d, generator=g) / d**0.5).to(device)
    bias = (torch.randn(e, generator=g) * 0.1).to(device)
    parts = router_partials(x, w, dot)
    assert parts.shape == (-(-d // 256), t, e)
    logits = router_logits_triton(x, w, dot).cpu()
    ref_w, ref_ids = sigmoid_topk_ref(logits.double(), bias.cpu().double(), a, True, 1.5)
    w_out, ids = sigmoid_topk_triton(parts, bias, a, True, 1.5)
    # rows whose choices come within 1e-5 of a tie may order differently between fp32 and fp64: not compared
    choice = torch.sigmoid(logits.double()) + bias.cpu().double()
    top = choice.topk(min(e, a + 1), dim=-1).values
    clear = (top[:, :-1] - top[:, 1:]).min(-1).values > 1e-5
    assert clear.float().mean() >= 0.5
    assert torch.equal(ids.cpu()[clear], ref_ids[clear])
    bound = (a + 2 * logits.abs().max().double() + 10) * U * ref_w.abs()
    assert_within("router weights", ref_w[clear].float(), w_out.cpu()[clear], bound[clear].float())


def check_router_one_launch(t: int, e: int, d: int, a: int, extra: int | None, device: str) -> None:
    """The one-launch router against the two launches it replaces, on the same inputs: the same picks (the
    same logits and scores: its last program sums the same partials in the same order), the renormalised
    weights within the bound of an fp32 sum's reordering ((A + 2) u |w|), the extra column as appended; and
    against the fp64 reference as check_router states it. A second call gives the same result: the arrival
    counter was put back to 0."""
    from k3run.kernels.moe_ops.triton import route_one_launch_triton as one_launch
    from k3run.kernels.moe_ops.triton import router_logits_triton, router_partials, sigmoid_topk_triton

    g = torch.Generator().manual_seed(t * 7 + e + d)
    x = torch.randn(t, d, generator=g).to(torch.float16).to(device)
    w = (torch.randn(e, d, generator=g) / d**0.5).to(device)
    bias = (torch.randn(e, generator=g) * 0.1).to(device)
    two_w, two_ids = sigmoid_topk_triton(router_partials(x, w), bias, a, True, 1.5, extra)
    one_w, one_ids = one_launch(x, w, bias, a, True, 1.5, extra)
    cols = a + (extra is not None)
    assert one_ids.shape == one_w.shape == (t, cols) and one_ids.dtype == torch.int64
    assert torch.equal(one_ids.cpu(), two_ids.cpu()), "the one-launch router picked other experts"
    assert_within("one-launch router weights", two_w.cpu(), one_w.cpu(), (a + 2) * U * two_w.cpu().abs())
    if extra is not None:
        assert (one_ids[:, a] == extra).all() and (one_w[:, a] == 1).all()
    again_w, again_ids = one_launch(x, w, bias, a, True, 1.5, extra)
    assert torch.equal(again_ids, one_ids) and torch.equal(again_w, one_w)
    # against the reference on the logits summed in the kernel's order (router_logits_triton), as check_router
    logits = router_logits_triton(x, w).cpu().double()
    ref_w, ref_ids = sigmoid_topk_ref(logits, bias.cpu().double(), a, True, 1.5, extra)
    choice = torch.sigmoid(logits) + bias.cpu().double()
    top = choice.topk(min(e, a + 1), dim=-1).values
    clear = (top[:, :-1] - top[:, 1:]).min(-1).values > 1e-5
    assert torch.equal(one_ids.cpu()[clear], ref_ids[clear])
    bound = (a + 2 * logits.abs().max() + 10) * U * ref_w.abs()
    assert_within(
        "one-launch router vs the reference", ref_w[clear].float(), one_w.cpu()[clear], bound[clear].float()
    )


def check_gated(
    n: int, i: int, kind: str, beta: float, lb: float | None, dtype: torch.dtype, device: str
) -> None:
    from k3run.kernels.moe_ops.triton import gated_triton

    g = torch.Generator().manual_seed(n * 7 + i)
    gu = (torch.randn(n, 2 * i, generator=g) * 4).to(dtype)
    ref = gated_ref(gu[:, :i].double(), gu[:, i:].double(), kind, beta, lb)
    out = gated_triton(gu.to(device), kind, beta, lb, dtype)
    assert out.dtype == dtype and out.shape == (n, i)
    bound = (2 * gu[:, :i].double().abs() + 16) * U * ref.abs() + output_ulp(ref.float(), dtype).double()
    assert_within(f"gated {kind}", ref.float(), out.cpu().float(), bound.float())


def check_combine(t: int, a: int, d: int, dtype: torch.dtype, device: str) -> None:
    from k3run.kernels.moe_ops.triton import combine_triton

    g = torch.Generator().manual_seed(t * a + d)
    y = torch.randn(t * a, d, generator=g).to(dtype)
    w = torch.rand(t, a, generator=g)
    ref = combine_ref(y.double(), w.double())
    out = combine_triton(y.to(device), w.to(device))
    s = combine_ref(y.double().abs(), w.double())
    assert_within("combine", ref.float(), out.cpu(), (2 * (a + 1) * U * s).float())


def check_combine_epilogue(t: int, a: int, d: int, dtype: torch.dtype, device: str) -> None:
    """out_dtype and add: the kernel's own fp32 sum rounded to dtype, then + add as torch adds, bit for
    bit (the fp32 sum itself is check_combine's); the reference does the same steps."""
    from k3run.kernels.moe_ops.triton import combine_triton

    g = torch.Generator().manual_seed(t + a * d)
    y = torch.randn(t * a, d, generator=g).to(dtype).to(device)
    w = torch.rand(t, a, generator=g).to(device)
    add = torch.randn(t, d, generator=g).to(dtype).to(device)
    acc = combine_triton(y, w)
    assert acc.dtype == torch.float32
    cast = combine_triton(y, w, dtype)
    assert cast.dtype == dtype and torch.equal(cast, acc.to(dtype))
    assert torch.equal(combine_triton(y, w, dtype, add), acc.to(dtype) + add)
    ref = combine_ref(y.cpu(), w.cpu(), dtype, add.cpu())
    assert torch.equal(ref, combine_ref(y.cpu(), w.cpu()).to(dtype) + add.cpu())
    with pytest.raises(ValueError, match="add must be"):
        combine_triton(y, w, dtype, add[:, 1:])


def test_references_match_layers_route() -> None:
    """sigmoid_topk_ref is layers.moe.route without group limits; gated_ref is layers.activation's math."""
    from k3run.layers.activation import GatedActivation
    from k3run.layers.moe import route

    logits, bias = _logits_case(5, 64, 1, "cpu")
    w0, i0 = route(logits, bias, 6, routed_scaling_factor=2.5)
    w1, i1 = sigmoid_topk_ref(logits, bias, 6, True, 2.5)
    assert torch.equal(i0, i1) and torch.equal(w0, w1)
    gu = torch.randn(4, 20) * 5
    for act in (GatedActivation("silu"), GatedActivation("situ", 4.0, 25.0), GatedActivation("situ", 3.0)):
        want = act(gu)
        got = gated_ref(gu[:, :10], gu[:, 10:], act.kind, act.beta or 0.0, act.linear_beta)
        assert torch.equal(want, got)


def test_router_module_routes_as_before() -> None:
    """MoERouter (through route_sigmoid_topk) equals the fp32 logits followed by layers.moe.route."""
    from k3run.layers.moe import MoERouter, RouterConfig, route

    r = MoERouter(64, 48, RouterConfig(top_k=6, routed_scaling_factor=2.0))
    r.weight.data.normal_()
    r.e_score_correction_bias.data.normal_()
    x = torch.randn(5, 48).bfloat16()
    w0, i0 = r(x)
    w1, i1 = route(x.float() @ r.weight.t(), r.e_score_correction_bias, 6, routed_scaling_factor=2.0)
    assert torch.equal(i0, i1) and torch.equal(w0, w1)


def test_references_reject_a_slip() -> None:
    """The bounds above are tight enough to see a real slip: the weights unscaled by 1 + 2^-16, a logit row
    computed without its last column, SiTU's beta at 4.01."""
    logits, bias = _logits_case(7, 50, 3, "cpu")
    ref_w, _ = sigmoid_topk_ref(logits.double(), bias.double(), 8, True, 1.0)
    bound = (8 + 2 * logits.abs().max().double() + 10) * U * ref_w.abs()
    assert ((ref_w * (1 + 2**-16) - ref_w).abs() > bound).any()
    gu = torch.randn(6, 40) * 4
    ref = gated_ref(gu[:, :20].double(), gu[:, 20:].double(), "situ", 4.0, 25.0)
    slip = gated_ref(gu[:, :20].double(), gu[:, 20:].double(), "situ", 4.01, 25.0)
    bound = (2 * gu[:, :20].double().abs() + 16) * U * ref.abs()
    assert ((slip - ref).abs() > bound).any()


def test_triton_kernels_in_interpreter() -> None:
    run_interp_tests_in_child(__file__, expected_passed=30)


@interp_only
@pytest.mark.parametrize("t, e, a", [(1, 37, 1), (3, 256, 8), (2, 896, 16), (5, 61, 7)])
def test_interp_sigmoid_topk(t: int, e: int, a: int) -> None:
    check_topk(t, e, a, renorm=a > 1, scale=2.446 if a > 1 else 1.0, device="cpu")


@interp_only
@pytest.mark.parametrize("t, e, a", [(3, 256, 8), (5, 61, 7)])
def test_interp_sigmoid_topk_extra_column(t: int, e: int, a: int) -> None:
    check_topk(t, e, a, renorm=True, scale=2.446, device="cpu", extra=e)


@interp_only
def test_interp_sigmoid_topk_ties_and_nan() -> None:
    check_topk_ties_and_nan("cpu")


@interp_only
@pytest.mark.parametrize("t, e, d", [(1, 37, 100), (5, 256, 231), (19, 10, 1030)])
def test_interp_router_logits(t: int, e: int, d: int) -> None:
    check_logits(t, e, d, torch.float16, "cpu")


@interp_only
@pytest.mark.parametrize("t, e, d, a", [(1, 37, 300, 4), (6, 256, 2304, 8), (2, 900, 1700, 16)])
def test_interp_router_partials_then_topk(t: int, e: int, d: int, a: int) -> None:
    check_router(t, e, d, a, "cpu")


@interp_only
@pytest.mark.parametrize("t, e, d, dot", [(7, 37, 300, False), (1, 20, 513, False), (19, 37, 300, True)])
def test_interp_router_partials_loaded_ahead_are_the_same_bits(t: int, e: int, d: int, dot: bool) -> None:
    """x loaded a token block ahead (the default) or each block after the last: the same products and sums.
    7 tokens: two 4-token blocks, the second part masked and the prefetch past it fully masked; 1 token: one
    block; the dot form's 16-token blocks over 19 tokens."""
    from k3run.kernels.moe_ops.triton import router_partials

    g = torch.Generator().manual_seed(t + e + d)
    x = torch.randn(t, d, generator=g).to(torch.bfloat16 if dot else torch.float16)
    w = torch.randn(e, d, generator=g) / d**0.5
    assert torch.equal(router_partials(x, w, dot, ahead=True), router_partials(x, w, dot, ahead=False))


@interp_only
def test_interp_router_dot_exact() -> None:
    check_dot_exact(19, 37, 300, "cpu")


@interp_only
@pytest.mark.parametrize("t, e, d, a", [(20, 37, 300, 4), (33, 256, 2304, 8)])
def test_interp_router_dot_partials(t: int, e: int, d: int, a: int) -> None:
    # 16-token blocks, the last masked; 37 experts in blocks of 16 (the last masked); 300 columns (2 blocks)
    check_logits(t, e, d, torch.bfloat16, "cpu", dot=True)
    check_router(t, e, d, a, "cpu", dot=True)


@interp_only
@pytest.mark.parametrize(
    "t, e, d, a, extra",
    [(1, 37, 300, 4, None), (6, 256, 2304, 8, 256), (3, 61, 999, 7, 5), (5, 1000, 520, 16, 3),
     (2, 1000, 2600, 16, None)],
)  # fmt: skip
# (5, 1000, ...): 2 tokens a block at 1024 expert columns, so the last program loops over 3 token blocks.
# (2, 900, 1700) and (2, 1000, 2600): more column blocks than the top-k sum loads at once (7 blocks, 4 at a
# time; 11, 8 at a time), so its last group of loads is partly masked
def test_interp_router_one_launch(t: int, e: int, d: int, a: int, extra: int | None) -> None:
    check_router_one_launch(t, e, d, a, extra, "cpu")


@interp_only
@pytest.mark.parametrize(
    "kind, beta, lb", [("silu", 1.0, None), ("situ", 4.0, 25.0), ("situ", 3.0, None)]
)  # fmt: skip
def test_interp_gated(kind: str, beta: float, lb: float | None) -> None:
    check_gated(3, 77, kind, beta, lb, torch.float16, "cpu")


@interp_only
@pytest.mark.parametrize("t, a, d", [(1, 8, 2304 // 9), (3, 5, 99)])
def test_interp_combine(t: int, a: int, d: int) -> None:
    check_combine(t, a, d, torch.float32, "cpu")


@interp_only
def test_interp_combine_epilogue() -> None:
    check_combine_epilogue(3, 5, 99, torch.float16, "cpu")


@needs_cuda
@pytest.mark.parametrize("t, e, a", [(1, 256, 8), (32, 256, 8), (7, 896, 16), (3, 61, 1)])
def test_gpu_sigmoid_topk(t: int, e: int, a: int) -> None:
    check_topk(t, e, a, renorm=a > 1, scale=2.446, device="cuda")
    check_topk(t, e, a, renorm=a > 1, scale=2.446, device="cuda", extra=e)


@needs_cuda
def test_gpu_sigmoid_topk_ties_and_nan() -> None:
    check_topk_ties_and_nan("cuda")


@needs_cuda
@pytest.mark.parametrize("t, e, d", [(1, 256, 2304), (8, 256, 2304), (64, 896, 7168), (3, 37, 1001)])
def test_gpu_router_logits(t: int, e: int, d: int) -> None:
    check_logits(t, e, d, torch.bfloat16, "cuda")
    check_router(t, e, d, min(e, 16), "cuda")


@needs_cuda
@pytest.mark.parametrize("t, e, d", [(32, 256, 2304), (64, 896, 7168), (17, 37, 1001), (9, 256, 2304)])
def test_gpu_router_dot_partials(t: int, e: int, d: int) -> None:
    check_dot_exact(t, e, d, "cuda")
    check_logits(t, e, d, torch.bfloat16, "cuda", dot=True)
    check_router(t, e, d, min(e, 16), "cuda", dot=True)


@needs_cuda
@pytest.mark.parametrize("knob", ["moe_router_dot", "moe_router_partials"])
def test_gpu_route_sigmoid_topk_takes_the_partials_under_its_knob(knob: str) -> None:
    """K3RUN_MOE_ROUTER_DOT=64 or (the dot form off) K3RUN_MOE_ROUTER_PARTIALS=64: 32 tokens route through
    the dot or the broadcast partials, against cuBLAS (the dot form off, the partials to 16 tokens). Wherever
    no two choices come within 1e-5, the picks equal cuBLAS's. Each logit then differs by at most 2 (d + 1)
    u s (s: the row's largest sum of |x| |w|, two fp32 sums of d terms; 3 (d + 1) u s for the dot form,
    whose tensor-core sums may truncate: 2 u an addition), so a renormalised weight differs by at most
    twice that relatively, plus the top-k's own roundings ((a + 10) u, as check_topk)."""
    from k3run.kernels.moe_ops import route_sigmoid_topk
    from k3run.knobs import override_knobs

    d, a = 2304, 8
    g = torch.Generator().manual_seed(5)
    x = torch.randn(32, d, generator=g).bfloat16().cuda()
    w = (torch.randn(256, d, generator=g) / d**0.5).cuda()
    bias = (torch.randn(256, generator=g) * 0.1).cuda()
    setting = {"moe_router_dot": 64, "moe_router_partials": 16}
    if knob == "moe_router_partials":
        setting = {"moe_router_dot": 0, "moe_router_partials": 64}
    with override_knobs(**setting):
        w_dot, ids_dot = route_sigmoid_topk(x, w, bias, a, True, 2.5)
    with override_knobs(moe_router_dot=0, moe_router_partials=16):
        w_off, ids_off = route_sigmoid_topk(x, w, bias, a, True, 2.5)
    logits = router_logits_ref(x.double(), w.double()).cpu()
    choice = torch.sigmoid(logits) + bias.cpu().double()
    top = choice.topk(a + 1, dim=-1).values
    clear = (top[:, :-1] - top[:, 1:]).min(-1).values > 1e-5
    assert clear.float().mean() >= 0.5
    assert torch.equal(ids_dot.cpu()[clear], ids_off.cpu()[clear])
    s_row = (x.double().abs() @ w.double().abs().t()).max(-1).values.cpu()
    rel = (6 if knob == "moe_router_dot" else 4) * (d + 1) * U * s_row[:, None] + (a + 10) * U
    ref_w = w_off.cpu().double()
    assert_within(
        f"router weights under {knob}",
        ref_w[clear].float(),
        w_dot.cpu()[clear],
        (rel * ref_w.abs())[clear].float(),
    )


@needs_cuda
@pytest.mark.parametrize(
    "t, e, d, a, extra", [(1, 256, 2304, 8, 256), (8, 256, 2304, 8, None), (1, 896, 7168, 16, None),
                          (5, 61, 1001, 7, 3)]
)  # fmt: skip
def test_gpu_router_one_launch(t: int, e: int, d: int, a: int, extra: int | None) -> None:
    check_router_one_launch(t, e, d, a, extra, "cuda")


@needs_cuda
def test_gpu_router_one_launch_in_a_graph() -> None:
    """Captured in a CUDA graph (as a decode step holds it) and replayed three times: the eager result bit
    for bit each time (the arrival counter is back at 0 after every launch)."""
    from k3run.engine.runner import warm_and_capture
    from k3run.kernels.moe_ops.triton import route_one_launch_triton

    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 2304, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(256, 2304, generator=g) / 48).cuda()
    bias = (torch.randn(256, generator=g) * 0.1).cuda()
    want_w, want_ids = route_one_launch_triton(x, w, bias, 8, True, 2.446, 256)
    graph, out, err = warm_and_capture(
        lambda: route_one_launch_triton(x, w, bias, 8, True, 2.446, 256), torch.device("cuda"), None
    )
    assert err is None and graph is not None and out is not None
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[0], want_w) and torch.equal(out[1], want_ids)


@needs_cuda
@pytest.mark.parametrize("kind, beta, lb", [("silu", 1.0, None), ("situ", 4.0, 25.0), ("situ", 3.0, None)])
def test_gpu_gated(kind: str, beta: float, lb: float | None) -> None:
    check_gated(9, 1024, kind, beta, lb, torch.bfloat16, "cuda")
    check_gated(2, 333, kind, beta, lb, torch.float16, "cuda")


@needs_cuda
@pytest.mark.parametrize("kind, beta, lb", [("silu", 1.0, None), ("situ", 4.0, 25.0)])
def test_gpu_gated_matches_torch_bits(kind: str, beta: float, lb: float | None) -> None:
    """On the GPU the kernel evaluates torch's operations in torch's order: the bf16 outputs equal torch's
    except where libdevice's exp / tanh and torch's CUDA build differ in the last fp32 bit and the value sits
    on a bf16 rounding midpoint (at most one bf16 ulp, at most 0.1% of the outputs)."""
    from k3run.kernels.moe_ops.triton import gated_triton
    from k3run.layers.activation import GatedActivation

    gu = (torch.randn(64, 2048, device="cuda") * 4).bfloat16()
    want = GatedActivation(kind, beta if kind == "situ" else None, lb)(gu)
    got = gated_triton(gu, kind, beta, lb, torch.bfloat16)
    diff = (got.float() - want.float()).abs()
    assert (diff <= output_ulp(want.float(), torch.bfloat16)).all()
    assert (diff > 0).float().mean() <= 1e-3


@needs_cuda
def test_gpu_sigmoid_topk_matches_torch() -> None:
    """The same picks as torch.topk on fp32 logits of a 256-expert router, scores bit-equal to torch's."""
    from k3run.kernels.moe_ops.triton import sigmoid_topk_triton

    logits, bias = _logits_case(128, 256, 9, "cuda")
    w0, i0 = sigmoid_topk_ref(logits, bias, 8, False, 1.0)
    w1, i1 = sigmoid_topk_triton(logits, bias, 8, False, 1.0)
    assert torch.equal(i0, i1) and torch.equal(w0, w1)


@needs_cuda
@pytest.mark.parametrize("t, a, d", [(1, 8, 2304), (32, 8, 2304), (5, 16, 7168)])
def test_gpu_combine(t: int, a: int, d: int) -> None:
    check_combine(t, a, d, torch.bfloat16, "cuda")
    check_combine_epilogue(t, a, d, torch.bfloat16, "cuda")
