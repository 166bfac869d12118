"""The NVFP4 wgmma GEMM (kernels/nvfp4_gemm/wgmma.py) against the fp32 reference, and its sm_90 compile on
the CPU.

Error bound (elementwise, from the dtypes; the argument of test_nvfp4_tile.py): the decoded weights are exact
in 16-bit floats, so every product x_k * w_k is exact in fp32 and the kernel and the reference differ only in
the order of K fp32 additions (split-K adds one more level of fixed-order fp32 sums): |out - ref| <=
3 K u (|x| @ |W|^T) |gs| + one output ulp (the single rounding to the 16-bit output dtype).
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch

from k3run.formats import dequantize_nvfp4
from k3run.kernels.nvfp4_gemm import prepare_nvfp4_weight
from tests.kernels.test_nvfp4_tile import _bound, _random_nvfp4

wg = pytest.importorskip("k3run.kernels.nvfp4_gemm.wgmma")


def check_tiled_gemm(gemm, name, m, n, k, dtype, per_row, bias, seed=0):
    """`gemm(x, tiled weight, bias)` on a random NVFP4 weight against the fp32 reference, within the module
    docstring's bound; returns its output. Shared by the sm_90 GEMMs' tests."""
    from k3run.testing import assert_within

    w, s, gs = _random_nvfp4(n, k, "cuda", per_row, seed=seed + m * 7 + n + k)
    tw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    g = torch.Generator(device="cuda").manual_seed(seed + m)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    b = torch.randn(n, device="cuda", generator=g).to(dtype) if bias else None
    out = gemm(x, tw, b)
    wd = dequantize_nvfp4(w, s, 1.0, dtype=torch.float32)
    ref = (x.float() @ wd.t()) * gs.reshape(1, -1)
    if b is not None:
        ref = ref + b.float()
    assert out.shape == (m, n) and out.dtype == dtype
    assert_within(f"{name} {m}x{n}x{k} {dtype}", ref, out, _bound(x, wd, gs, ref, dtype))
    return out


def _case(m, n, k, dtype, per_row, bias, config=None, seed=0, ss=False, gather=False):
    def gemm(x, tw, b):
        return wg.nvfp4_wgmma_gemm(
            x, tw.weight, tw.scale_bits, tw.global_scale, k, n, b, config=config, ss=ss, gather=gather
        )

    name = f"wgmma gemm {config} ss={ss} gather={gather}"
    return check_tiled_gemm(gemm, name, m, n, k, dtype, per_row, bias, seed)


def _need_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 17, 64, 100, 255, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_odd_shapes(poison_empty, m: int, dtype: torch.dtype) -> None:
    """Odd M (token tiles with rows past M), N not a multiple of the row block (200: padded to 208 rows,
    the last program past them), K = 336 (pads to 384: the K tail masked), per-row scales and a bias."""
    _need_sm90()
    _case(m, 200, 336, dtype, per_row=m % 2 == 0, bias=m in (17, 255))
    _case(m, 1024, 1024, dtype, per_row=False, bias=False)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [(64, 16, 1, 3), (128, 32, 2, 5), (64, 64, 3, 4), (128, 128, 2, 5), (64, 32, 6, 3), (128, 256, 1, 3)],
)
def test_gpu_configs(poison_empty, config) -> None:
    """Program shapes the launcher may take over K of 6 chunks: split-K (fixed-order partial sums) with 3, 2
    and 1 chunk per program (a ring deeper than the program's chunks is refused: its prologue would commit
    empty copy groups), both warp counts, token tiles 16..256."""
    _need_sm90()
    _case(150, 328, 720, torch.bfloat16, per_row=True, bias=True, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "m, config",
    [
        (17, None),
        (100, None),
        (255, None),
        (150, (64, 64, 2, 3)),
        (150, (128, 32, 3, 3)),
        (150, (64, 16, 6, 3)),
    ],  # fmt: skip
)
def test_gpu_shared_memory_operand(poison_empty, m: int, config, dtype: torch.dtype) -> None:
    """The shared-memory A operand form (ss): odd M, N and K, split-K with 2, 3 and 1 chunks per program (the
    1-2 chunk programs take the runtime trip count), and the case where the register form's constant-count
    build raced (100 x 1024 x 1024): ten calls, each within the bound and all bit-identical."""
    _need_sm90()
    if config is None:
        _case(m, 200, 336, dtype, per_row=m % 2 == 0, bias=m in (17, 255), ss=True)
        outs = [_case(m, 1024, 1024, dtype, per_row=False, bias=False, ss=True) for _ in range(10)]
        assert all(torch.equal(outs[0], o) for o in outs[1:])
    else:
        _case(m, 328, 720, dtype, per_row=True, bias=True, config=config, ss=True)


@pytest.mark.gpu
def test_gpu_split_k_is_deterministic() -> None:
    """The last program of a tile sums the partials in a fixed order: two runs give the same bits."""
    _need_sm90()
    w, s, gs = _random_nvfp4(512, 2048, "cuda", False, seed=3)
    tw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    x = torch.randn(40, 2048, device="cuda").to(torch.bfloat16)
    cfg = (128, 64, 8, 4)
    y1 = wg.nvfp4_wgmma_gemm(x, tw.weight, tw.scale_bits, tw.global_scale, 2048, 512, config=cfg)
    y2 = wg.nvfp4_wgmma_gemm(x, tw.weight, tw.scale_bits, tw.global_scale, 2048, 512, config=cfg)
    assert torch.equal(y1, y2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "m, config", [(1, None), (17, None), (32, None), (37, (64, 16, 6, 3)), (64, (128, 32, 3, 4)), (255, None)]
)
def test_gpu_x_gathered_in_the_kernel_equals_the_reordered_copy(poison_empty, m, config, dtype) -> None:
    """gather=True: the kernel's copies take x as it is, in the operand's column order (4-byte pieces), and
    the launch is PDL (its first weight chunks copied before it waits). The same products are summed in the
    same order as with x reordered by `rs_columns` first, so the outputs are the same bits, and within the
    module docstring's bound. Odd M (token rows past M), N and K (336 pads to 384), split-K with 1 and 2
    chunks a program."""
    _need_sm90()
    for n, k, cfg in ((200, 336, None), (328, 720, config)):
        got = _case(m, n, k, dtype, per_row=m % 2 == 1, bias=m > 30, config=cfg, gather=True)
        want = _case(m, n, k, dtype, per_row=m % 2 == 1, bias=m > 30, config=cfg, gather=False)
        assert torch.equal(got, want), f"{m}x{n}x{k} {cfg}"


@pytest.mark.gpu
def test_gpu_pdl_chain_reads_each_previous_output_in_a_graph() -> None:
    """Three gathered (PDL) calls back to back, each reading the one before's output, eager and replayed from
    a CUDA graph: the same bits as the chain without PDL (x reordered by a copy). A launch that read its x
    before the previous kernel finished would read stale rows. (Values grow ~50x a layer: 1e5 at the end,
    far inside bf16's range.)"""
    _need_sm90()
    dims = [2304, 1536, 2304, 1024]
    tws = []
    for i in range(3):
        w, s, gs = _random_nvfp4(dims[i + 1], dims[i], "cuda", False, seed=40 + i)
        tws.append(prepare_nvfp4_weight(w, s, gs, layout="tiled128"))
    x = torch.randn(32, dims[0], device="cuda").to(torch.bfloat16)

    def chain(gather: bool) -> torch.Tensor:
        h = x
        for i, tw in enumerate(tws):
            h = wg.nvfp4_wgmma_gemm(
                h, tw.weight, tw.scale_bits, tw.global_scale, dims[i], dims[i + 1], gather=gather
            )
        return h

    want = chain(False)
    assert torch.equal(chain(True), want)
    chain(True)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(True)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


def test_x_gather_copies_4_byte_pieces_and_stages_weights_before_the_pdl_wait() -> None:
    """The sm_90 PTX of the gathered build: x's 16-byte copies become four 4-byte copies each (the weight
    and scale copies unchanged); with PDL the prologue copies only weight words (16-byte) and scale words
    (4-byte) before `griddepcontrol.wait`, signals its dependents after the K loop's last wgmma issue, and
    keeps the SASS checks of the register form (no spills, no stores in the K loop, no write to an
    in-flight A operand)."""
    from tests.kernels.test_nvfp4_gemv_compile import cubin_usage_and_sass

    def copies(ptx: str) -> tuple[int, int]:
        sizes = re.findall(r"cp\.async\.c[ag]\.shared\.global[^;]*,\s*(0x10|0x4)\s*,", ptx)
        return sizes.count("0x10"), sizes.count("0x4")

    bn, bt, stages = 128, 32, 4
    plain = _compile(bn, bt, 1, stages, 2304, "bf16")
    gathered = _compile(bn, bt, 1, stages, 2304, "bf16", xg=True, pdl=True)
    (p16, p4), (g16, g4) = copies(plain.asm["ptx"]), copies(gathered.asm["ptx"])
    x16 = p16 - g16  # the x copies that were 16 bytes
    assert x16 > 0 and g4 == p4 + 4 * x16, ((p16, p4), (g16, g4))
    ptx = gathered.asm["ptx"]
    # (the compiler may duplicate the wait on a branch that skips the K loop; the first is the main path's)
    assert ptx.count("griddepcontrol.launch_dependents") == 1
    head = ptx[: ptx.index("griddepcontrol.wait")]
    # the prologue's STAGES - 2 chunks: 2 word copies (a [128, 16] int32 tile over 256 threads) and 1
    # scale-word copy each, nothing else
    assert copies(head) == (2 * (stages - 2), stages - 2), copies(head)
    assert ptx.index("griddepcontrol.launch_dependents") > ptx.rindex("wgmma.mma_async")
    res, sass = cubin_usage_and_sass(gathered)
    assert _stores_in_loops(sass) == 0 and wgmma_register_hazards(sass) == []
    use = re.search(r"REG:(\d+) STACK:(\d+)", res)
    assert use is not None and int(use.group(2)) == 0, res


def test_refuses_bad_input_and_config() -> None:
    w = torch.zeros(32, 64, dtype=torch.uint8)
    s = torch.zeros(32, 8, dtype=torch.uint8)
    gs = torch.ones(1)
    with pytest.raises(ValueError, match="bf16/fp16"):
        wg.nvfp4_wgmma_gemm(torch.zeros(4, 128), w, s, gs, 128, 32)
    with pytest.raises(ValueError, match="sm_90"):
        wg.nvfp4_wgmma_gemm(torch.zeros(4, 128, dtype=torch.bfloat16), w, s, gs, 128, 32)


def test_rs_columns_is_the_register_order() -> None:
    """Position 16b + 8p + 2t + e of each 64-column half holds column 16t + 4b + 2p + e."""
    x = torch.arange(2 * 256, dtype=torch.float32).reshape(2, 256)
    y = wg.rs_columns(x)
    for pos in range(256):
        half, r = divmod(pos, 64)
        b, p, t, e = r // 16, (r // 8) % 2, (r // 2) % 4, r % 2
        assert y[1, pos] == x[1, half * 64 + 16 * t + 4 * b + 2 * p + e]


@pytest.mark.parametrize(
    "m, n, k", [(1, 7168, 7168), (64, 7168, 7168), (256, 12288, 7168), (4096, 7168, 12288)]
)
def test_config_fits_shared_memory_and_divides_k(m: int, n: int, k: int) -> None:
    bn, bt, split, stages = wg.wgmma_config(m, n, k)
    assert bn in (64, 128) and bt >= min(m, 128) and (k // 128) % split == 0
    assert 3 <= stages <= k // 128 // split + 2 and wg.smem_bytes(bn, bt, stages) <= 227 * 1024


@pytest.mark.parametrize("bt", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("k", [128, 1024, 2304, 3584])
def test_grouped_config_ring(bt: int, k: int) -> None:
    """4-slot rings where two programs then share an SM (up to 64 picks a block), else the deepest ring that
    fits one (<= 8 slots, <= the chunks + 2)."""
    r, stages = wg.grouped_config(bt, k)
    chunks = k // 128
    assert r == 128 and 3 <= stages <= max(3, chunks + 2) and wg.smem_bytes(r, bt, stages) <= wg._SMEM_BUDGET
    if bt <= 64:
        assert stages == min(4, chunks + 2) and 2 * wg.smem_bytes(r, bt, stages) <= 227 * 1024
    else:
        deeper = stages + 1
        assert deeper > min(8, chunks + 2) or wg.smem_bytes(r, bt, deeper) > wg._SMEM_BUDGET


def _compile(
    bn: int, bt: int, split: int, stages: int, k: int, dtype: str, ss: bool = False, xg: bool = False,
    pdl: bool = False,
):  # fmt: skip
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from k3run.kernels.nvfp4_gemm.tile import word_asm

    triton = pytest.importorskip("triton")
    lw, lw2, lx, acc, la, lo, xs, lcw, lcs, ps = wg.layouts(bn, bt)
    consts = dict(
        K_PAD=-(-k // 128) * 128, BN=bn, BT=bt, SPLIT_K=split, STAGES=stages, PER_COL_GS=True, HAS_BIAS=True,
        ASM=word_asm(dtype), OUT_SCALE=128.0, LW=lw, LW2=lw2, LX=lx, ACC=acc, LA=la, LO=lo, XS=xs, LCW=lcw,
        LCS=lcs, PS=ps, SS=ss, STATIC_NCH=wg.constant_trip_count(ss, -(-k // 128) // split), XG=xg, PDL=pdl,
    )  # fmt: skip
    ptrs = dict(
        x_ptr=f"*{dtype}", w_ptr="*i32", s_ptr="*i32", gs_ptr="*fp32", b_ptr=f"*{dtype}", y_ptr=f"*{dtype}",
        ws_ptr="*fp32", cnt_ptr="*i32", M="i32", N="i32", N_PAD="i32", stride_xm="i32", stride_ym="i32",
        nch="i32",
    )  # fmt: skip
    order = list(inspect.signature(wg._wgmma_kernel.fn).parameters)
    sig = {name: ("constexpr" if name in consts else ptrs[name]) for name in order}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(order) if name.endswith("_ptr")}
    attrs.update({(order.index(s),): [["tt.divisibility", 16]] for s in ("stride_xm", "stride_ym")})
    src = GluonASTSource(wg._wgmma_kernel, sig, {(order.index(c),): v for c, v in consts.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": bn // 16})


@pytest.mark.parametrize(
    "bn, bt, split, stages, k, dtype",
    [(128, 128, 1, 5, 7168, "bf16"), (64, 32, 1, 8, 3600, "fp16"), (128, 16, 2, 8, 2304, "bf16")],
)
def test_compiles_for_sm90_with_async_wgmma_and_no_spills(bn, bt, split, stages, k, dtype) -> None:
    """Two async wgmma per chunk from registers, waited down to the newest chunk's (not to zero) inside the
    loop, no shared-memory store inside the K loop (the decoded words land in the operand registers), and no
    local memory."""
    from tests.kernels.test_nvfp4_gemv_compile import cubin_usage_and_sass

    ck = _compile(bn, bt, split, stages, k, dtype)
    ptx = ck.asm["ptx"]
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{bt}k16\.f32\.(bf16|f16)\.(bf16|f16) \{{", ptx)
    assert "wgmma.wait_group.sync.aligned 2;" in ptx
    res, sass = cubin_usage_and_sass(ck)
    assert _stores_in_loops(sass) == 0
    assert wgmma_register_hazards(sass) == []
    use = re.search(r"REG:(\d+) STACK:(\d+)", res)
    assert use is not None and int(use.group(2)) == 0, res


@pytest.mark.parametrize("bn, bt, split, stages, k", [(64, 64, 2, 3, 7168), (128, 128, 1, 3, 7168)])
def test_shared_memory_operand_keeps_two_chunks_of_wgmma_in_flight(bn, bt, split, stages, k) -> None:
    """The ss form: the A operand is a shared-memory descriptor, and ptxas keeps the K loop's wgmma in flight
    (no `WARPGROUP.DEPBAR.LE gsb0, 0x0` right after an HGMMA inside the loop, one wait for two groups at its
    end), with no local memory."""
    from tests.kernels.test_nvfp4_gemv_compile import cubin_usage_and_sass

    res, sass = cubin_usage_and_sass(_compile(bn, bt, split, stages, k, "bf16", ss=True))
    seq = re.findall(r"(HGMMA\.\S+ R\d+, (?:R\d+|gdesc)|WARPGROUP\.DEPBAR\.LE gsb0, 0x\w+)", sass)
    assert seq and all("gdesc" in x for x in seq if x.startswith("HGMMA"))
    waits = [x for x in seq if x.startswith("WARPGROUP")]
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x2" in waits and waits.count("WARPGROUP.DEPBAR.LE gsb0, 0x0") == 1
    assert wgmma_register_hazards(sass) == []
    use = re.search(r"REG:(\d+) STACK:(\d+)", res)
    assert use is not None and int(use.group(2)) == 0, res


_NO_DEST = {
    "ST", "STS", "STG", "STL", "LDGSTS", "BAR", "BRA", "HGMMA", "RED", "WARPGROUP", "DEPBAR", "LDGDEPBAR",
    "EXIT", "NOP", "WARPSYNC", "FENCE", "MEMBAR", "CCTL", "ERRBAR", "SYNCS", "UTMALDG",
}  # fmt: skip


def _written(ins: str) -> set[int]:
    """General registers an instruction writes: its first operand (R n, and n + 1..3 for .64 / .128)."""
    m = re.match(r"(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s+R(\d+)\b", ins)
    if m is None or m.group(2).split(".")[0] in _NO_DEST:
        return set()
    width = 4 if ".128" in m.group(2) else 2 if ".64" in m.group(2) or ".WIDE" in m.group(2) else 1
    return {int(m.group(3)) + i for i in range(width)}


def wgmma_register_hazards(sass: str) -> list[tuple[str, str]]:
    """Instructions in a K loop that write a register holding the A operand of a wgmma (HGMMA) still in
    flight: the PTX ISA leaves that undefined (the tensor cores may read the old or the new value). Walks each
    loop body containing HGMMA twice (the second pass starts with what the first left in flight, the
    loop's back edge) as straight-line code: HGMMA adds its A registers (R n..n + 3) to the open group,
    `gsb0` closes it, `WARPGROUP.DEPBAR.LE gsb0, N` keeps the newest N groups."""
    code = _sass_code(sass)
    found = []
    for lo, hi in _loops(code):
        body = [(a, i) for a, i in code if lo <= a <= hi]
        if not any("HGMMA" in i for _, i in body):
            continue
        pending: list[set[int]] = []
        group: set[int] = set()
        for second in (False, True):
            for a, i in body:
                if "HGMMA" in i:
                    op = re.search(r"HGMMA\.\S+\s+R\d+,\s+R(\d+),", i)
                    if op:  # A from registers (an A from shared memory is a descriptor)
                        group |= {int(op.group(1)) + j for j in range(4)}
                    if "gsb0" in i:
                        pending.append(group)
                        group = set()
                    continue
                wait = re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s+0x([0-9a-f]+)", i)
                if wait:
                    keep = int(wait.group(1), 16)
                    pending = pending[len(pending) - keep :] if keep else []
                    continue
                if second and _written(i) & set().union(group, *pending):
                    found.append((hex(a), i))
    return found


def test_register_hazard_check_finds_a_write_to_an_in_flight_operand() -> None:
    """The checker on hand-written loops: a write to R90 (A of the pending group) before its wait is found;
    the same write after `WARPGROUP.DEPBAR.LE gsb0, 0x0`, or to another register, is not."""
    head = "/*0100*/ WARPGROUP.ARRIVE ;\n/*0110*/ HGMMA.64x64x16.F32.BF16 R24, R88, gdesc[UR4], R24, gsb0 ;\n"
    tail = "/*0140*/ @P0 BRA 0x100 ;\n"
    bad = head + "/*0120*/ LOP3.LUT R90, R3, 0xf, RZ, 0xc0, !PT ;\n/*0130*/ WARPGROUP.DEPBAR.LE gsb0, 0x1 ;\n"
    good = (
        head + "/*0120*/ WARPGROUP.DEPBAR.LE gsb0, 0x0 ;\n/*0130*/ LOP3.LUT R90, R3, 0xf, RZ, 0xc0, !PT ;\n"
    )
    other = (
        head + "/*0120*/ LOP3.LUT R92, R3, 0xf, RZ, 0xc0, !PT ;\n/*0130*/ WARPGROUP.DEPBAR.LE gsb0, 0x1 ;\n"
    )
    assert [h[0] for h in wgmma_register_hazards(bad + tail)] == ["0x120"]
    assert wgmma_register_hazards(good + tail) == []
    assert wgmma_register_hazards(other + tail) == []


def _sass_code(sass: str) -> list[tuple[int, str]]:
    """cuobjdump -sass text as (address, instruction) pairs."""
    return [(int(a, 16), i.strip()) for a, i in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]


def _loops(code: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(first, last) addresses of each backward branch's range: the kernel's loops."""
    ranges = []
    for a, ins in code:
        target = re.search(r"\bBRA\s+(?:\S+\s+)?0x([0-9a-f]+)", ins)
        if target and int(target.group(1), 16) <= a:
            ranges.append((int(target.group(1), 16), a))
    return ranges


def _stores_in_loops(sass: str) -> int:
    """STS instructions inside the kernel's backward-branch ranges (its K loops)."""
    code = _sass_code(sass)
    ranges = _loops(code)
    return sum(
        1 for a, ins in code if any(lo <= a <= hi for lo, hi in ranges) and re.match(r"(@!?P\w+\s+)?STS", ins)
    )


# ---- grouped experts (nvfp4_wgmma_grouped): the tile GEMM's grouped cases and bounds ----


@pytest.mark.gpu
@pytest.mark.parametrize(
    "t, a, e, bt, skew",
    [(33, 4, 9, 16, "random"), (200, 8, 32, 64, "random"), (150, 2, 5, 64, "one"), (64, 8, 64, 32, "random"),
     (700, 6, 7, 128, "random"), (300, 8, 3, 256, "one")],
)  # fmt: skip
def test_gpu_grouped(t: int, a: int, e: int, bt: int, skew: str) -> None:
    """Experts with no picks, one expert taking every pick, other ranks' picks, blocks of 16..256 picks; K =
    384 (three chunks) and K = 336 (padded to 384)."""
    from tests.kernels.test_nvfp4_tile import _grouped_case

    _need_sm90()
    _grouped_case(t, a, e, 256, 384, bt, torch.bfloat16, "cuda", skew, fn=wg.nvfp4_wgmma_grouped)
    _grouped_case(t, a, e, 208, 336, bt, torch.float16, "cuda", skew, fn=wg.nvfp4_wgmma_grouped)


@pytest.mark.gpu
@pytest.mark.parametrize("act", [("silu", None, None), ("situ", 4.0, 25.0), ("situ", 2.0, None)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bt", [32, 128])
def test_gpu_grouped_gated_epilogue(act, dtype: torch.dtype, bt: int) -> None:
    """GEMM1's activation epilogue against the same launch without it + layers/activation.py on its halves
    (the bound of test_nvfp4_tile._gated_case); I = 240 (not a multiple of the 64 output columns a program
    owns: the last program's rows past the gate half re-read real rows, never stored)."""
    from tests.kernels.test_nvfp4_tile import _gated_case

    _need_sm90()
    _gated_case(150, 4, 6, 256, 512, bt, act, "cuda", dtype, fn=wg.nvfp4_wgmma_grouped)
    _gated_case(90, 3, 5, 240, 384, bt, act, "cuda", dtype, fn=wg.nvfp4_wgmma_grouped)


def test_grouped_refuses_bad_input() -> None:
    w = torch.zeros(2, 64, 64, dtype=torch.uint8)
    s = torch.zeros(2, 64, 8, dtype=torch.uint8)
    gs = torch.ones(2, 1)
    grp = torch.zeros(1, 17, dtype=torch.int32)
    with pytest.raises(ValueError, match="bf16/fp16"):
        wg.nvfp4_wgmma_grouped(torch.zeros(4, 128), w, s, gs, grp, picks=4, x_div=1, k=128)
    with pytest.raises(ValueError, match="sm_90"):
        x = torch.zeros(4, 128, dtype=torch.bfloat16)
        wg.nvfp4_wgmma_grouped(x, w, s, gs, grp, picks=4, x_div=1, k=128)


def _compile_grouped(r: int, bt: int, stages: int, k: int, gated: int, dtype: str):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from k3run.kernels.nvfp4_gemm.tile import word_asm

    triton = pytest.importorskip("triton")
    lw, lw2, lx, acc, la, lo, xs, lcw, lcs, ps, l3 = wg.grouped_layouts(r, bt, bool(gated))
    consts = dict(
        K_PAD=-(-k // 128) * 128, R=r, BT=bt, STAGES=stages, PER_COL_GS=True, GATED=gated,
        BETA=4.0 if gated == 2 else 0.0, LINEAR_BETA=25.0 if gated == 2 else 0.0, ASM=word_asm(dtype),
        OUT_SCALE=128.0, LW=lw, LW2=lw2, LX=lx, ACC=acc, LA=la, LO=lo, XS=xs, LCW=lcw, LCS=lcs, PS=ps, L3=l3,
    )  # fmt: skip
    ptrs = dict(
        x_ptr=f"*{dtype}", w_ptr="*i32", s_ptr="*i32", gs_ptr="*fp32", y_ptr=f"*{dtype}", grp_ptr="*i32",
        N_OUT="i32", N_ROWS="i32", stride_xm="i32", stride_ym="i32", x_div="i32", w_estride="i32",
        s_estride="i32", gs_estride="i32", nch="i32",
    )  # fmt: skip
    kern = wg._wgmma_grouped_kernel
    order = list(inspect.signature(kern.fn).parameters)
    sig = {name: ("constexpr" if name in consts else ptrs[name]) for name in order}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(order) if name.endswith("_ptr")}
    attrs.update({(order.index(s),): [["tt.divisibility", 16]] for s in ("stride_xm", "stride_ym")})
    src = GluonASTSource(kern, sig, {(order.index(c),): v for c, v in consts.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": r // 16})


@pytest.mark.parametrize(
    "r, bt, stages, k, gated, dtype",
    [(128, 64, 5, 2304, 1, "bf16"), (128, 128, 5, 3072, 2, "fp16"), (64, 32, 4, 1024, 0, "bf16")],
)
def test_grouped_compiles_for_sm90_with_async_wgmma_and_no_spills(r, bt, stages, k, gated, dtype) -> None:
    """The grouped kernel: async wgmma from registers waited down to the newest chunk's, x rows gathered by
    16-byte cp.async, no shared-memory store in the K loop, no local memory."""
    from tests.kernels.test_nvfp4_gemv_compile import cubin_usage_and_sass

    ck = _compile_grouped(r, bt, stages, k, gated, dtype)
    ptx = ck.asm["ptx"]
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{bt}k16\.f32\.(bf16|f16)\.(bf16|f16) \{{", ptx)
    assert "wgmma.wait_group.sync.aligned 2;" in ptx
    copies = re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], (0x\w+)", ptx)
    assert copies and "0x10" in copies, copies[:4]
    res, sass = cubin_usage_and_sass(ck)
    assert _stores_in_loops(sass) == 0
    assert wgmma_register_hazards(sass) == []
    use = re.search(r"REG:(\d+) STACK:(\d+)", res)
    assert use is not None and int(use.group(2)) == 0, res


def test_x_gather_default_follows_the_measured_bound() -> None:
    """The default gather decision against bench_wgmma's H200 cases (bench/RESULTS.md run 141), BN 64 as
    wgmma_config picks up to 64 rows: gathered where it measured faster, reordered where slower; never with
    the knob at 0, never above the knob's rows."""
    from k3run.kernels.nvfp4_gemm.wgmma import gather_x
    from k3run.knobs import override_knobs

    faster = [(17, 12448, 2304), (32, 2304, 4096), (64, 2304, 4096), (32, 2048, 2304), (64, 2048, 2304)]
    slower = [(32, 12448, 2304), (64, 12448, 2304)]
    with override_knobs(wgmma_x_gather=64):
        assert all(gather_x(m, n, k, 64) for m, n, k in faster)
        assert not any(gather_x(m, n, k, 64) for m, n, k in slower)
    with override_knobs(wgmma_x_gather=0):
        assert not any(gather_x(m, n, k, 64) for m, n, k in faster)
    with override_knobs(wgmma_x_gather=32):
        assert gather_x(32, 2048, 2304, 64) and not gather_x(33, 2048, 2304, 64)
