"""The CUDA C++ NVFP4 GEMM for sm_90 (kernels/nvfp4_gemm/w4a16_sm90.cu) against the fp32 reference, and its
sm_90a compile on the CPU (nvcc, when this machine has one).

Error bound (elementwise, from the dtypes; test_nvfp4_tile.py's argument): the decoded weights are exact in
16-bit floats, so every product x_k * w_k is exact in fp32 and the kernel and the reference differ only in the
order of K fp32 additions (split-K adds one fixed-order level): |out - ref| <= 3 K u (|x| @ |W|^T) |gs| + one
output ulp (the single rounding to the 16-bit output dtype).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from k3run.formats import dequantize_nvfp4
from k3run.kernels.nvfp4_gemm import prepare_nvfp4_weight
from k3run.kernels.nvfp4_gemm import w4a16_sm90 as sm90
from tests.kernels.test_nvfp4_tile import _bound, _random_nvfp4
from tests.kernels.test_nvfp4_wgmma import _loops, _sass_code, wgmma_register_hazards


def _need_kernel():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    if not sm90.available():
        pytest.fail(f"the sm_90 CUDA GEMM did not build: {sm90._error}")


def _case(m, n, k, dtype, per_row, bias, config=None, seed=0):
    from k3run.testing import assert_within

    w, s, gs = _random_nvfp4(n, k, "cuda", per_row, seed=seed + m * 7 + n + k)
    tw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    g = torch.Generator(device="cuda").manual_seed(seed + m)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    b = torch.randn(n, device="cuda", generator=g).to(dtype) if bias else None
    out = sm90.nvfp4_sm90_gemm(x, tw.weight, tw.scale_bits, tw.global_scale, k, n, b, config=config)
    wd = dequantize_nvfp4(w, s, 1.0, dtype=torch.float32)
    ref = (x.float() @ wd.t()) * gs.reshape(1, -1)
    if b is not None:
        ref = ref + b.float()
    assert out.shape == (m, n) and out.dtype == dtype
    assert_within(f"sm90 gemm {m}x{n}x{k} {dtype} {config}", ref, out, _bound(x, wd, gs, ref, dtype))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 17, 64, 100, 255, 300, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_odd_shapes(poison_empty, m: int, dtype: torch.dtype) -> None:
    """Odd M (token tiles with rows past M; 300 and 1000 take several 128-token tiles), N not a multiple of
    the CTA's rows (200: 208 tiled rows, the CTA's last row blocks absent), K = 336 (padded to 384),
    per-row scales and a bias."""
    _need_kernel()
    _case(m, 200, 336, dtype, per_row=m % 2 == 0, bias=m in (17, 255, 300))
    _case(m, 1024, 1024, dtype, per_row=False, bias=False)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [(16, 1, 1, 2), (32, 2, 2, 3), (64, 1, 3, 4), (64, 2, 6, 2), (128, 2, 2, 5), (128, 1, 1, 8),
     (256, 1, 1, 3), (256, 1, 3, 2)],
)  # fmt: skip
def test_gpu_configs(poison_empty, config) -> None:
    """Every token tile, one and two consumer warpgroups, split-K with 6, 3, 2 and 1 chunk per CTA (odd and
    even chunk counts: the loop's pair and its tail), rings of 2 to 8 slots (deeper than the chunks too)."""
    _need_kernel()
    _case(150, 328, 720, torch.bfloat16, per_row=True, bias=True, config=config)
    _case(40, 336, 768, torch.float16, per_row=False, bias=False, config=config)


@pytest.mark.gpu
def test_gpu_repeats_are_bit_identical() -> None:
    """No race: ten calls of one split-K case (fixed-order partial sums) and of one unsplit case give the
    same bits."""
    _need_kernel()
    w, s, gs = _random_nvfp4(1024, 2048, "cuda", False, seed=3)
    tw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    x = torch.randn(100, 2048, device="cuda").to(torch.bfloat16)
    for cfg in [(128, 2, 8, 4), (128, 2, 1, 6)]:
        outs = [
            sm90.nvfp4_sm90_gemm(x, tw.weight, tw.scale_bits, tw.global_scale, 2048, 1024, config=cfg)
            for _ in range(10)
        ]
        assert all(torch.equal(outs[0], o) for o in outs[1:]), cfg


@pytest.mark.gpu
def test_gpu_linear_takes_it_and_matches_the_gluon_kernel(monkeypatch) -> None:
    """With K3RUN_SM90_CUDA=1, nvfp4_linear's choice for 17..256 rows on sm_90 runs this kernel; its output is
    within the bound of the Gluon wgmma kernel's (the same products, summed in another order)."""
    from k3run.kernels.nvfp4_gemm import choose_config, nvfp4_linear
    from k3run.kernels.nvfp4_gemm.wgmma import nvfp4_wgmma_gemm

    _need_kernel()
    monkeypatch.setattr(sm90, "_ENABLED", True)
    assert choose_config(64, 4096, 4096, wgmma=True).wgmma
    w, s, gs = _random_nvfp4(4096, 4096, "cuda", False, seed=5)
    tw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    x = torch.randn(64, 4096, device="cuda").to(torch.bfloat16)
    y = nvfp4_linear(x, tw)
    y_gluon = nvfp4_wgmma_gemm(x, tw.weight, tw.scale_bits, tw.global_scale, 4096, 4096)
    wd = dequantize_nvfp4(w, s, 1.0, dtype=torch.float32)
    ref = (x.float() @ wd.t()) * gs.reshape(1, -1)
    bound = 2 * _bound(x, wd, gs, ref, torch.bfloat16)
    assert bool(((y.float() - y_gluon.float()).abs() <= bound).all())


def test_refuses_bad_input_and_config() -> None:
    w = torch.zeros(32, 64, dtype=torch.uint8)
    s = torch.zeros(32, 8, dtype=torch.uint8)
    gs = torch.ones(1)
    with pytest.raises(ValueError, match="bf16/fp16"):
        sm90.nvfp4_sm90_gemm(torch.zeros(4, 128), w, s, gs, 128, 32)


@pytest.mark.parametrize(
    "m, n, k",
    [(17, 7168, 7168), (64, 7168, 7168), (256, 12288, 7168), (256, 7168, 12288), (1000, 2048, 2304)],
)
def test_config_fits_shared_memory_and_divides_k(m: int, n: int, k: int) -> None:
    bt, nwg, split, stages = sm90.sm90_config(m, n, k, 132)
    chunks = -(-k // 128)
    assert bt in sm90.TOKEN_TILES and nwg in sm90.WARPGROUPS and chunks % split == 0 and stages >= 2
    assert sm90.smem_bytes(bt, nwg, stages) <= sm90.SMEM_LIMIT
    assert bt >= min(m, 128)


def test_wrappers_cover_every_token_tile_and_dtype() -> None:
    src = sm90.cuda_source()
    assert "//@@WGMMA@@" not in src
    for bt in sm90.TOKEN_TILES:
        for ty in ("bf16", "f16"):
            assert f"m64n{bt}k16.f32.{ty}.{ty} {{%0," in src


def _tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for root in ("/usr/local/cuda/bin", "/usr/local/cuda-13.0/bin"):
        if Path(root, name).exists():
            return str(Path(root, name))
    try:
        import triton

        p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
        return str(p) if p.exists() else None
    except ImportError:
        return None


@pytest.fixture(scope="module")
def standalone_build(tmp_path_factory):
    """The .cu file compiled for sm_90a without torch (every kernel instantiated): ptxas's report and SASS."""
    nvcc, cuobjdump = _tool("nvcc"), _tool("cuobjdump")
    if nvcc is None or cuobjdump is None:
        pytest.skip("needs nvcc and cuobjdump")
    d = tmp_path_factory.mktemp("sm90")
    (d / "k.cu").write_text(sm90.cuda_source())
    cmd = [nvcc, "-DK3W_STANDALONE", "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-cubin",
           "-Xptxas", "-v", "-o", str(d / "k.cubin"), str(d / "k.cu")]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if res.returncode != 0 and "Unsupported gpu architecture" in res.stderr:
        pytest.skip(f"this nvcc cannot build sm_90a: {res.stderr[:200]}")
    assert res.returncode == 0, res.stderr[-3000:]
    sass = subprocess.run(
        [cuobjdump, "-sass", str(d / "k.cubin")], capture_output=True, text=True, timeout=300
    )
    assert sass.returncode == 0, sass.stderr
    return res.stderr + res.stdout, sass.stdout


def test_compiles_without_serialized_wgmma_or_spills(standalone_build) -> None:
    """ptxas serializes no wgmma (C7513 / C7515 ...) and spills nothing, in every instantiation."""
    report, _ = standalone_build
    assert "wgmma.mma_async instructions are serialized" not in report, report
    assert re.findall(r"(\d+) bytes spill stores", report) and all(
        v == "0" for v in re.findall(r"(\d+) bytes spill stores", report)
    ), report
    assert all(v == "0" for v in re.findall(r"(\d+) bytes stack frame", report)), report


def test_keeps_a_chunk_in_flight_with_no_register_hazard(standalone_build) -> None:
    """Inside each GEMM kernel's K loop: HGMMAs from registers, waited down to one group (0x1, never 0x0
    inside the loop), and no instruction writes a register of an A operand still in flight."""
    _, sass = standalone_build
    kernels = [f for f in re.split(r"\n\s+Function : ", sass) if f.startswith("_ZN3k3w12w4a16_kernel")]
    assert len(kernels) == 11
    for f in kernels:
        code = _sass_code(f)
        assert wgmma_register_hazards(f) == [], f.split("\n")[0]
        loops = [(lo, hi) for lo, hi in _loops(code) if any("HGMMA" in i for a, i in code if lo <= a <= hi)]
        assert loops, f.split("\n")[0]
        lo, hi = min(loops, key=lambda r: r[1] - r[0])  # the pair loop
        body = [i for a, i in code if lo <= a <= hi]
        waits = [i for i in body if "WARPGROUP.DEPBAR" in i]
        assert waits and all(w.endswith("0x1") for w in waits), waits
        assert sum("HGMMA" in i for i in body) == 16
        assert all(re.search(r"HGMMA\.\S+\s+R\d+,\s+R\d+,", i) for i in body if "HGMMA" in i)
