"""The Gluon NVFP4 decode kernel (kernels/nvfp4_gemm/gluon_gemv.py) on a GPU against the fp32 reference.

Its PTX decoder is checked on the CPU by an emulator (test_nvfp4_gemm.py); everything else needs sm_80+.
"""

from __future__ import annotations

import pytest
import torch

from k3run.kernels.nvfp4_gemm import GemmConfig, nvfp4_linear, nvfp4_linear_ref, prepare_nvfp4_weight
from k3run.testing import RTOL, assert_close
from tests.kernels.test_nvfp4_gemm import _random_nvfp4

pytestmark = pytest.mark.gpu


def stacked_experts(n_exp: int, n: int, k: int, t: int, a: int, per_row: bool = False):
    """n_exp random NVFP4 experts [n, k] as the grouped launches take them (tiled128, stacked: codes, scales,
    global scales [E, N_pad or 1]) with their checkpoint tensors, and the picks of t tokens: a distinct ids
    each from range(-1, n_exp + 1), so some belong to other ranks (-1 and n_exp); seeded by t."""
    raw = [_random_nvfp4(n, k, device="cuda", per_row_global=per_row) for _ in range(n_exp)]
    ps = [prepare_nvfp4_weight(*r, layout="tiled128") for r in raw]
    w = torch.stack([p.weight for p in ps])
    s = torch.stack([p.scale_bits for p in ps])
    gs = torch.stack([p.global_scale.reshape(-1) for p in ps])
    g = torch.Generator().manual_seed(t)
    ids = torch.stack([torch.randperm(n_exp + 2, generator=g)[:a] - 1 for _ in range(t)]).reshape(-1)
    return raw, w, s, gs, ids.to(torch.int32).cuda()


@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 17, 32, 45])
@pytest.mark.parametrize(
    "num_warps, split_k, stages, layout",
    [
        (1, 1, 2, "split128"), (1, 3, 3, "split128"), (2, 4, 2, "split128"), (4, 2, 4, "split128"),
        (1, 8, 2, "tiled128"), (1, 5, 2, "tiled128"), (1, 1, 4, "tiled128"), (2, 3, 2, "tiled128"),
        (1, 7, 8, "tiled128"), (4, 2, 3, "tiled128"),
    ],
)  # fmt: skip
def test_gemv_odd_shapes_bf16(poison_empty, m: int, num_warps: int, split_k: int, stages: int, layout: str):
    """N = 520 (not a multiple of 16 * num_warps), K = 3600 (pads to 3712: a partial last chunk), bias,
    per-row global scales, token tiles 8 / 16 / 32 and M = 45 in two launches (32 + 13), both weight layouts
    (split128's byte-permute decoder, tiled128's shift decoder), more slots than some programs have K tiles:
    bf16 output rounding bounds the relative RMS error (RTOL[torch.bfloat16])."""
    n, k = 520, 3600
    w, s, gs = _random_nvfp4(n, k, device="cuda", per_row_global=True)
    pw = prepare_nvfp4_weight(w, s, gs, layout=layout)
    x = torch.randn(m, k, device="cuda").bfloat16()
    bias = torch.randn(n, device="cuda").bfloat16()
    cfg = GemmConfig(gemv=True, num_warps=num_warps, split_k=split_k, smem_stages=stages)
    ref = nvfp4_linear_ref(x.float(), w, s, gs, bias.float())
    y = nvfp4_linear(x, pw, bias, config=cfg)
    assert_close(f"gemv m={m} {cfg}", ref, y, rtol=RTOL[torch.bfloat16])
    # the split-K arrival counters are reset by every launch: a second call gives the same bits
    assert torch.equal(y, nvfp4_linear(x, pw, bias, config=cfg))


@pytest.mark.parametrize(
    "m, split_k, stages, layout", [(1, 1, 2, "split128"), (5, 4, 3, "split128"), (16, 7, 2, "tiled128"),
                                   (3, 4, 4, "tiled128")]
)  # fmt: skip
def test_gemv_fp16_exact_k(poison_empty, m: int, split_k: int, stages: int, layout: str):
    """fp16, K a multiple of 128 (the unmasked x path), per-tensor global scale, no bias."""
    n, k = 4096 + 48, 7168
    w, s, gs = _random_nvfp4(n, k, device="cuda")
    pw = prepare_nvfp4_weight(w, s, gs, layout=layout)
    x = torch.randn(m, k, device="cuda").half()
    cfg = GemmConfig(gemv=True, split_k=split_k, smem_stages=stages)
    y = nvfp4_linear(x, pw, config=cfg)
    assert_close(f"gemv fp16 m={m}", nvfp4_linear_ref(x.float(), w, s, gs), y, rtol=RTOL[torch.float16])


@pytest.mark.parametrize("form", ["1/1", "1/2", "2/2", "1/4"])
@pytest.mark.parametrize("m", [17, 32])
@pytest.mark.parametrize("n, k", [(576, 2304), (128, 2304), (2304, 1024), (6144, 2304), (2304, 4096)])
def test_gemv_tile32_split_rule_on_kimi_linear_shapes(poison_empty, m: int, n: int, k: int, form: str):
    """choose_config's 32-token launch where `tile32_split` cuts K into 2-8 programs of >= 3 chunks (split 6
    of K = 2304's 18 chunks, 2 of K = 1024's 8, 8 of K = 4096's 32), in four K3RUN_GEMV_T32_FORM program
    forms, on the default layout through nvfp4_linear: bf16 output rounding bounds the relative RMS error
    (RTOL[torch.bfloat16])."""
    from k3run.kernels.nvfp4_gemm import choose_config, sm_count
    from k3run.knobs import override_knobs

    w, s, gs = _random_nvfp4(n, k, device="cuda")
    pw = prepare_nvfp4_weight(w, s, gs)
    x = torch.randn(m, k, device="cuda").bfloat16()
    with override_knobs(gemv_t32_form=form):
        cfg = choose_config(m, n, k, sm_count(0))
    assert cfg.gemv and cfg.split_k >= 1
    y = nvfp4_linear(x, pw, config=cfg)
    assert_close(
        f"gemv m={m} {n}x{k} {cfg}", nvfp4_linear_ref(x.float(), w, s, gs), y, rtol=RTOL[torch.bfloat16]
    )


@pytest.mark.parametrize("m", [9, 13, 16, 17, 30, 32, 45])
@pytest.mark.parametrize(
    "num_warps, token_warps, split_k, layout",
    [(1, 2, 1, "tiled128"), (1, 4, 5, "tiled128"), (2, 2, 3, "tiled128"), (4, 2, 2, "tiled128"),
     (1, 2, 4, "split128"), (2, 4, 2, "split128")],
)  # fmt: skip
def test_program_shapes_give_the_one_warp_bits(
    poison_empty, m: int, num_warps: int, token_warps: int, split_k: int, layout: str
):
    """Row warps and token warps only move rows and token columns between warps: each output's mma steps
    and split-K partials are the same in the same order, so y is bit-equal to the one-warp launch at the
    same split (and within the bf16 bound, RTOL[torch.bfloat16], of the fp32 reference). N = 520 (not a
    multiple of the program's rows), K = 3600 (a partial last chunk), bias, per-row global scales, rows
    9..45 (45: 32 + 13 in two launches; nvfp4_linear gives token warps to the 32-token tile only)."""
    n, k = 520, 3600
    w, s, gs = _random_nvfp4(n, k, device="cuda", per_row_global=True)
    pw = prepare_nvfp4_weight(w, s, gs, layout=layout)
    x = torch.randn(m, k, device="cuda").bfloat16()
    bias = torch.randn(n, device="cuda").bfloat16()
    one = GemmConfig(gemv=True, split_k=split_k, smem_stages=2)
    cfg = GemmConfig(gemv=True, num_warps=num_warps, split_k=split_k, smem_stages=2, token_warps=token_warps)
    y = nvfp4_linear(x, pw, bias, config=cfg)
    assert torch.equal(y, nvfp4_linear(x, pw, bias, config=one)), f"m={m} {cfg}"
    assert_close(f"gemv m={m} {cfg}", nvfp4_linear_ref(x.float(), w, s, gs, bias.float()), y,
                 rtol=RTOL[torch.bfloat16])  # fmt: skip


@pytest.mark.parametrize("m", [9, 16])
def test_token_warps_on_the_16_token_tile_give_the_one_warp_bits(poison_empty, m: int):
    """nvfp4_gemv itself also splits the 16-token tile over 2 token warps (8 columns each): bit-equal to one
    warp (N = 520, K = 3600, split 3)."""
    from k3run.kernels.nvfp4_gemm.gluon_gemv import nvfp4_gemv

    w, s, gs = _random_nvfp4(520, 3600, device="cuda")
    pw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    x = torch.randn(m, 3600, device="cuda").bfloat16()
    args = (x, pw.weight, pw.scale_bits, pw.global_scale)
    y = nvfp4_gemv(*args, tiled=True, rows=520, split_k=3, token_warps=2)
    assert torch.equal(y, nvfp4_gemv(*args, tiled=True, rows=520, split_k=3))
    assert_close(f"gemv16 x2 m={m}", nvfp4_linear_ref(x.float(), w, s, gs), y, rtol=RTOL[torch.bfloat16])


def test_token_warps_reject_a_tile_narrower_than_8_columns_a_warp():
    """nvfp4_gemv itself refuses 4 token warps on the 16-token tile (4 columns a warp) and any on the 8-token
    tile, naming the value and the tile."""
    from k3run.kernels.nvfp4_gemm.gluon_gemv import nvfp4_gemv

    w, s, gs = _random_nvfp4(64, 256, device="cuda")
    pw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    for m, tw, bt in ((16, 4, 16), (8, 2, 8), (20, 3, 32)):
        x = torch.randn(m, 256, device="cuda").bfloat16()
        with pytest.raises(ValueError, match=f"got {tw} for the {bt}-token"):
            nvfp4_gemv(x, pw.weight, pw.scale_bits, pw.global_scale, tiled=True, rows=64, token_warps=tw)


@pytest.mark.parametrize("layout", ["split128", "tiled128"])
def test_gemv_strided_input_and_negative_zero(poison_empty, layout: str):
    """x as a row-strided view; weights containing -0 codes and subnormal (2^-9) group scales; split128 (the
    byte-permute decoder) and tiled128 (the shift decoder)."""
    n, k = 96, 640
    w, s, gs = _random_nvfp4(n, k, device="cuda")
    w[:, ::7] = 0x88  # -0 in both nibbles
    s.view(torch.uint8)[:, ::5] = 0x01  # E4M3 subnormal 2^-9
    pw = prepare_nvfp4_weight(w, s, gs, layout=layout)
    big = torch.randn(4, 2 * k, device="cuda").bfloat16()
    x = big[:, :k]
    y = nvfp4_linear(x, pw, config=GemmConfig(gemv=True, split_k=2, smem_stages=2))
    assert_close("gemv strided", nvfp4_linear_ref(x.float(), w, s, gs), y, rtol=RTOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout, stages", [("split128", 2), ("tiled128", 4)])
def test_gemv_every_e4m3_scale_exact(poison_empty, dtype: torch.dtype, layout: str, stages: int):
    """Every finite non-negative E4M3 group scale (0x00..0x7E: zero, subnormals, 448) with one code per
    row: the product must match the fp32 reference to one output rounding in every element (the cp.async
    kernel on tiled128 converts the scale bytes with cvt.f16x2.e4m3x2, and for bf16 decodes by shifts into
    bf16 subnormals for the e = 0 codes: a flush-to-zero anywhere would show here)."""
    n, k = 128, 2048
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
    s = (torch.arange(n * k // 16, device="cuda") % 127).to(torch.uint8).reshape(n, k // 16)
    gs = torch.tensor([1.0], device="cuda")
    pw = prepare_nvfp4_weight(w, s.view(torch.float8_e4m3fn), gs, layout=layout)
    eye = torch.zeros(16, k, device="cuda", dtype=dtype)
    for t in range(16):  # one-hot inputs: y[t] is column k of the dequantized weight, exactly representable
        eye[t, 7 * t + 64 * (t % 3)] = 1.0
    y = nvfp4_linear(eye, pw, config=GemmConfig(gemv=True, split_k=2, smem_stages=stages))
    ref = nvfp4_linear_ref(eye.float(), w, s.view(torch.float8_e4m3fn), gs)
    assert torch.equal(y.float(), ref.to(dtype).float()), (y.float() - ref).abs().max()


@pytest.mark.parametrize("m", [1, 9, 17])
def test_gemv_tiled_layout_bit_identical(poison_empty, m: int):
    """tile_split128 (rows padded to 16, K tiles stored contiguously, the shift decoder for bf16) gives the
    same bits as split128 (byte-permute tables) through the cp.async kernel: N = 520 (padded to 528),
    K = 3600, per-row global scales, bias. Same products up to the exact 2^-7 factor, same summation order."""
    from k3run.kernels.nvfp4_gemm.gluon_gemv import nvfp4_gemv, tile_split128

    n, k = 520, 3600
    w, s, gs = _random_nvfp4(n, k, device="cuda", per_row_global=True)
    pw = prepare_nvfp4_weight(w, s, gs, layout="split128")
    x = torch.randn(m, k, device="cuda").bfloat16()
    bias = torch.randn(n, device="cuda").bfloat16()
    tw, ts = tile_split128(pw.weight, pw.scale_bits)
    assert tw.shape == (528, pw.weight.shape[1])
    gs_pad = torch.cat([pw.global_scale, pw.global_scale.new_ones(8)])
    want = nvfp4_gemv(x, pw.weight, pw.scale_bits, pw.global_scale, bias, split_k=1, stages=4)
    got = nvfp4_gemv(x, tw, ts, gs_pad, bias, split_k=1, stages=4, tiled=True, rows=n)
    assert torch.equal(want, got)
    assert_close("tiled", nvfp4_linear_ref(x.float(), w, s, gs, bias.float()), got, rtol=RTOL[torch.bfloat16])


@pytest.mark.parametrize("graph", [False, True])
def test_gemv_pdl_chain_reads_each_previous_output(poison_empty, graph: bool):
    """Programmatic dependent launch (the default on sm_90+): a chain of launches where each input is the
    previous output (x_{i+1} = y_i, outputs allocated NaN-poisoned) must wait for the previous launch before
    reading x and before its split-K reduction; the chain gives the same bits with and without PDL, eager and
    replayed from a CUDA graph."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90+")
    from k3run.kernels.nvfp4_gemm.gluon_gemv import nvfp4_gemv

    n = k = 2048
    pws = []
    for _ in range(6):
        w, s, gs = _random_nvfp4(n, k, device="cuda")
        pws.append(prepare_nvfp4_weight(w, s, gs / k**0.5, layout="tiled128"))  # keeps |y| ~ |x|
    x0 = torch.randn(1, k, device="cuda").bfloat16()

    def chain(x: torch.Tensor, pdl: bool) -> torch.Tensor:
        for p in pws:
            x = nvfp4_gemv(
                x, p.weight, p.scale_bits, p.global_scale, split_k=8, stages=2, tiled=True, rows=n, pdl=pdl
            )
        return x

    pdl_matches_plain(chain, x0, graph)


def pdl_matches_plain(run, x0: torch.Tensor, graph: bool) -> None:
    """run(x, pdl) with PDL gives the bits of run(x0, False) (finite, not all zero), eagerly and, with
    `graph`, replayed three times from a CUDA graph captured after a warm-up call (kernels compiled)."""
    want = run(x0, False)
    assert bool(torch.isfinite(want).all()) and want.float().abs().max() > 0
    assert torch.equal(run(x0, True), want)
    if graph:
        static_x = x0.clone()
        run(static_x, True)  # compile outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = run(static_x, True)
        for _ in range(3):
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want)


@pytest.mark.parametrize("per_row", [False, True])
def test_gemv_grouped_matches_single_launches(per_row: bool):
    """nvfp4_gemv_grouped: pick s gives the bits of nvfp4_gemv(x[s // A], W[ids[s]]) at the same split_k (the
    same programs in the same order); ids outside [0, E) give zero rows. E = 5 experts, N = 520 (rows padded
    to 528), K = 3504 (not a multiple of 128), T = 3 tokens x A = 4 picks with two misses; per-expert scalar
    or per-row global scales."""
    from k3run.kernels.nvfp4_gemm.gluon_gemv import nvfp4_gemv, nvfp4_gemv_grouped

    n_exp, n, k, t, a = 5, 520, 3504, 3, 4
    raw = [_random_nvfp4(n, k, device="cuda", per_row_global=per_row) for _ in range(n_exp)]
    ps = [prepare_nvfp4_weight(*r, layout="tiled128") for r in raw]
    w = torch.stack([p.weight for p in ps])
    s = torch.stack([p.scale_bits for p in ps])
    gs = torch.stack([p.global_scale.reshape(-1) for p in ps])  # [E, 528] or [E, 1]
    ids = torch.tensor([0, 4, 2, -1, 3, 3, 1, 0, 7, 2, 4, 1], dtype=torch.int32, device="cuda")
    x = torch.randn(t, k, device="cuda").bfloat16()
    for split in (1, 4):
        y = nvfp4_gemv_grouped(x, w, s, gs, ids, rows=n, split_k=split)
        assert y.shape == (t * a, n)
        for si, e in enumerate(ids.tolist()):
            if not 0 <= e < n_exp:
                assert not bool(y[si].any()), (split, si)
                continue
            p = ps[e]
            xs = x[si // a : si // a + 1]
            want = nvfp4_gemv(
                xs, p.weight, p.scale_bits, p.global_scale, split_k=split, stages=2, tiled=True, rows=n
            )
            assert torch.equal(y[si], want[0]), (split, si, e)
    e = int(ids[5])
    assert_close("grouped", nvfp4_linear_ref(x[1:2].float(), *raw[e]), y[5:6], rtol=RTOL[torch.bfloat16])
    with pytest.raises(ValueError, match="picks for 3 tokens"):
        nvfp4_gemv_grouped(x, w, s, gs, ids[:10], rows=n)
    with pytest.raises(ValueError, match="global scale"):
        nvfp4_gemv_grouped(x, w, s, gs.new_ones(n_exp, 3), ids, rows=n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("form", ["passes", "atomic"])
@pytest.mark.parametrize("t, bt", [(3, 8), (8, 8), (12, 16), (20, 8), (40, 16), (40, 32), (75, 32)])
def test_gemv_by_expert_matches_per_pick_launch(t: int, bt: int, form: str):
    """nvfp4_gemv_by_expert (expert-major groups from expert_groups) gives the bits of nvfp4_gemv_grouped
    (one pick per program) for every pick, zero rows for other ranks' experts, at split_k 1 and 4 and weight
    rings of 2 to 4 slots: a column
    of the token tile is computed exactly as a one-token launch computes it. Token rows as x (slot_div = A,
    GEMM1) and pick rows as x (slot_div = 1, GEMM2). E = 5, N = 520, K = 3504, A = 4 distinct picks per token
    drawn from 7 ids (two of them outside [0, E)); T = 20 / 40 / 75 put more than bt picks on an expert
    (several groups per expert); bt = 32 is the 32-token tile. Both group-table forms: the atomic one's
    picks come in the order its atomics land, so the bits must not depend on a pick's column or group."""
    from k3run.kernels.nvfp4_gemm.gluon_gemv import nvfp4_gemv_by_expert, nvfp4_gemv_grouped
    from k3run.kernels.nvfp4_gemm.groups import expert_groups, expert_groups_ref, same_groups
    from k3run.knobs import override_knobs

    n_exp, n, k, a = 5, 520, 3504, 4
    _, w, s, gs, ids = stacked_experts(n_exp, n, k, t, a)
    with override_knobs(moe_groups=form):
        grp = expert_groups(ids, n_exp, bt)
    want_grp = expert_groups_ref(ids.cpu(), n_exp, bt)
    assert torch.equal(grp.cpu(), want_grp) if form == "passes" else same_groups(grp, want_grp)
    x = torch.randn(t, k, device="cuda").bfloat16()
    xp = torch.randn(t * a, k, device="cuda").bfloat16()
    for split, stages in ((1, 2), (4, 2), (1, 3), (4, 3), (1, 4)):  # a deeper ring changes no sum's order
        kw = dict(picks=t * a, rows=n, split_k=split, stages=stages)
        want = nvfp4_gemv_grouped(x, w, s, gs, ids, rows=n, split_k=split)
        got = nvfp4_gemv_by_expert(x, w, s, gs, grp, slot_div=a, **kw)
        assert torch.equal(got, want), (split, stages)
        want = nvfp4_gemv_grouped(xp, w, s, gs, ids, rows=n, split_k=split)
        got = nvfp4_gemv_by_expert(xp, w, s, gs, grp, slot_div=1, **kw)
        assert torch.equal(got, want), (split, stages)
    with pytest.raises(ValueError, match="groups"):
        nvfp4_gemv_by_expert(x, w, s, gs, grp[:, :5], picks=t * a, slot_div=a, rows=n)


@pytest.mark.parametrize("by_expert", [False, True])
@pytest.mark.parametrize("graph", [False, True])
def test_gemm2_reads_its_table_before_the_pdl_wait(poison_empty, by_expert: bool, graph: bool):
    """GEMM2 with early_table / early_ids reads the table (or ids) and stages its first weight tiles before
    its PDL wait: it relies on the table being complete when it launches (written before GEMM1, which waits
    for its predecessor before it lets GEMM2 launch). Two MoE layers back to back, each grouping its own
    routing (the second's table may reuse the first's memory), GEMM1 -> GEMM2 with PDL, eager and replayed
    from a CUDA graph: the bits of the same launches without PDL. A table read before it was written would
    give the other layer's groups (different experts, other rows)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90+")
    from k3run.kernels.nvfp4_gemm.gluon_gemv import nvfp4_gemv_by_expert, nvfp4_gemv_grouped
    from k3run.kernels.nvfp4_gemm.groups import expert_groups

    n_exp, n, k, t, a = 7, 1040, 528, 6, 3  # GEMM1 [1040, 528], GEMM2 [528, 1040]
    _, w1, s1, g1, _ = stacked_experts(n_exp, n, k, t, a)
    _, w2, s2, g2, _ = stacked_experts(n_exp, k, n, t, a)
    gen = torch.Generator().manual_seed(11)
    routes = [torch.stack([torch.randperm(n_exp, generator=gen)[:a] for _ in range(t)]).reshape(-1)
              for _ in range(2)]  # fmt: skip
    routes = [r.to(torch.int32).cuda() for r in routes]
    x0 = torch.randn(t, k, device="cuda").bfloat16()

    def layers(x: torch.Tensor, pdl: bool) -> torch.Tensor:
        for r in routes:
            ids = r.clone()  # written by a kernel just before the layer, as the router's picks are
            if by_expert:
                grp = expert_groups(ids, n_exp, 8)
                h = nvfp4_gemv_by_expert(x, w1, s1, g1, grp, picks=t * a, slot_div=a, rows=n, pdl=pdl)
                y = nvfp4_gemv_by_expert(
                    h, w2, s2, g2, grp, picks=t * a, slot_div=1, rows=k, pdl=pdl, early_table=pdl
                )
            else:
                h = nvfp4_gemv_grouped(x, w1, s1, g1, ids, rows=n, pdl=pdl)
                y = nvfp4_gemv_grouped(h, w2, s2, g2, ids, rows=k, pdl=pdl, early_ids=pdl)
            x = (y.float().reshape(t, a, k).sum(1) / 64).bfloat16()
        return x

    pdl_matches_plain(layers, x0, graph)
