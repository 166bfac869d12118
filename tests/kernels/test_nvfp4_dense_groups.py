"""Dense NVFP4 linears of 17..32 rows as 8-token groups of the expert-major decode launch
(GemmConfig.token_groups, K3RUN_DENSE_TILE8): the choice and the group table on the CPU, the output on a GPU
against the fp32 reference and the 32-token tile.

Bound: the kernel's products are exact in fp32 and the output is rounded once to bf16, so the relative RMS
error against the fp32 reference stays within RTOL[torch.bfloat16] (as test_nvfp4_gemv_gpu.py argues); the
two kernels differ by their fp32 summation orders and that rounding: twice the bound between them.
"""

from __future__ import annotations

import pytest
import torch

from k3run.kernels.nvfp4_gemm import (
    GemmConfig,
    choose_config,
    nvfp4_linear,
    nvfp4_linear_ref,
    prepare_nvfp4_weight,
    token_groups,
)
from k3run.knobs import reset_knobs
from k3run.testing import RTOL, assert_close
from tests.kernels.test_nvfp4_gemm import _random_nvfp4


def test_choice_follows_the_knob(monkeypatch) -> None:
    """Off by default (the 32-token tile at 17..32 rows); K3RUN_DENSE_TILE8=24 takes 17..24 rows of a
    Kimi Linear matrix (12448 x 2304: the decode kernel's range on sm_90 too) as 8-token groups, with a
    split_k dividing the 18 chunks; 25..32 rows and 16 keep their launches."""
    monkeypatch.delenv("K3RUN_DENSE_TILE8", raising=False)
    reset_knobs()
    assert choose_config(24, 12448, 2304, 132, wgmma=True).token_groups == 0
    monkeypatch.setenv("K3RUN_DENSE_TILE8", "24")
    reset_knobs()
    try:
        for m in (17, 24):
            cfg = choose_config(m, 12448, 2304, 132, wgmma=True)
            assert cfg.gemv and cfg.token_groups == 8 and 18 % cfg.split_k == 0, (m, cfg)
        assert choose_config(25, 12448, 2304, 132, wgmma=True).token_groups == 0
        assert choose_config(16, 12448, 2304, 132, wgmma=True).token_groups == 0
        assert choose_config(24, 7168, 7168, 132, wgmma=True).wgmma  # >= 32M weights: the wgmma GEMM
    finally:
        monkeypatch.delenv("K3RUN_DENSE_TILE8")
        reset_knobs()


def test_group_table_covers_the_rows_once() -> None:
    for m in (17, 24, 29, 32):
        t = token_groups(torch.device("cpu"), m, 8)
        assert t.dtype == torch.int32 and t.shape == (-(-m // 8), 9)
        assert bool((t[:, 0] == 0).all())
        rows = t[:, 1:].flatten()
        assert rows[rows >= 0].tolist() == list(range(m)) and int((rows < 0).sum()) == t.shape[0] * 8 - m


@pytest.mark.gpu
@pytest.mark.parametrize("m", [17, 24, 29, 32])
@pytest.mark.parametrize("per_row", [False, True])
def test_gpu_groups_match_the_reference_and_the_32_token_tile(poison_empty, m: int, per_row: bool) -> None:
    """N = 520 (rows padded to 528), K = 3008 (24 chunks, a partial last one), split_k 1 and 3 (8 chunks a
    program: the split-K reduction and its counters), per-tensor and per-row global scales; with a bias the
    32-token launch runs instead (the grouped launch has none)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    n, k = 520, 3008
    w, s, gs = _random_nvfp4(n, k, device="cuda", per_row_global=per_row)
    pw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    x = torch.randn(m, k, device="cuda").bfloat16()
    ref = nvfp4_linear_ref(x.float(), w, s, gs)
    tile32 = nvfp4_linear(x, pw, config=GemmConfig(gemv=True, split_k=2, smem_stages=2))
    for split in (1, 3):
        cfg = GemmConfig(gemv=True, split_k=split, smem_stages=2, token_groups=8)
        y = nvfp4_linear(x, pw, config=cfg)
        assert_close(f"groups m={m} split {split}", ref, y, rtol=RTOL[torch.bfloat16])
        assert_close(f"groups vs 32-token tile m={m}", tile32.float(), y, rtol=2 * RTOL[torch.bfloat16])
        assert torch.equal(y, nvfp4_linear(x, pw, config=cfg))  # counters reset: the same bits again
    bias = torch.randn(n, device="cuda").bfloat16()
    yb = nvfp4_linear(x, pw, bias, config=GemmConfig(gemv=True, split_k=1, smem_stages=2, token_groups=8))
    assert_close(f"groups with bias m={m}", nvfp4_linear_ref(x.float(), w, s, gs, bias.float()), yb,
                 rtol=RTOL[torch.bfloat16])  # fmt: skip
