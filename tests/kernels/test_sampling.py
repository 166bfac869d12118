"""kernels/sampling: inverse-CDF sampling in three Triton launches against the torch reference (on the CPU).

Both take the weights exp(s - max(s)) in fp32 of the same fp32 s (IEEE division by the temperature) and the
first token whose inclusive float64 cumulative weight exceeds u times the row's total. The weights can differ
by an fp32 ulp (the kernels' exp is libdevice's on the GPU and numpy's in the interpreter, the reference's
torch's on the CPU), and the kernels sum in float64 chunk by chunk where torch scans: the cumulative sums
agree to ~1e-7 of the total. So the tokens are compared on the rows whose target lies more than 1e-5 of the
total from every boundary (at least half of them by construction), and there they must be equal."""

from __future__ import annotations

import pytest
import torch

from k3run.kernels.sampling import sample_inverse_cdf_ref
from tests.interpreter_utils import interp_only, run_interp_tests_in_child


def _spec(rows: list[int], temps: list[float], us: list[float]) -> torch.Tensor:
    return torch.tensor([[r, t, 0, 1.0, u] for r, t, u in zip(rows, temps, us)], dtype=torch.float64)


def _clear(logits: torch.Tensor, spec: torch.Tensor, scaled: bool, want: torch.Tensor, margin: float):
    """Rows whose target u x total lies more than `margin` x total inside the reference token's interval
    (cdf[k - 1], cdf[k]], or exactly at 0 with no weight before the token (u = 0: exact in any order)."""
    sel = spec[:, 0].long()
    s = logits if scaled else logits.index_select(0, sel) / spec[:, 1:2].float()
    cdf = (s - s.amax(-1, keepdim=True)).exp().double().cumsum(-1)
    total = cdf[:, -1]
    target = spec[:, 4] * total
    k = want[sel]
    hi = cdf.gather(1, k[:, None])[:, 0]
    lo = torch.where(k > 0, cdf.gather(1, (k - 1).clamp(min=0)[:, None])[:, 0], torch.zeros_like(hi))
    at_zero = (target == 0) & (lo == 0)  # the first token of nonzero weight, whatever the order of sums
    return at_zero | ((target - lo > margin * total) & (hi - target > margin * total))


def check_sampling(b: int, v: int, chunk: int, scaled: bool, device: str, margin: float) -> None:
    from k3run.kernels.sampling.triton import sample_inverse_cdf_triton

    g = torch.Generator().manual_seed(b * 1000 + v + chunk)
    logits = torch.randn(b, v, generator=g) * 3
    rows = list(range(b - 1, -1, -2))  # every other row, in reverse order
    us = [0.0, 0.999999, *torch.rand(len(rows), generator=g).tolist()][: len(rows)]
    spec = _spec(rows, [0.7 + 0.1 * i for i in range(len(rows))], us)
    if scaled:  # rows already divided and masked: -inf outside each row's top 40
        x = logits[rows] / spec[:, 1:2].float()
        kth = x.topk(min(40, v), dim=-1).values[:, -1:]
        logits = x.masked_fill(x < kth, float("-inf"))
    want = sample_inverse_cdf_ref(logits, spec, torch.full((b,), -1, dtype=torch.int64), scaled)
    got = sample_inverse_cdf_triton(
        logits.to(device), spec.to(device), torch.full((b,), -1, dtype=torch.int64, device=device), scaled,
        chunk=chunk,
    ).cpu()  # fmt: skip
    clear = _clear(logits, spec, scaled, want, margin)
    assert clear.float().mean() >= 0.5
    sel = spec[:, 0].long()
    assert torch.equal(got[sel][clear], want[sel][clear]), (got[sel], want[sel])
    untouched = torch.ones(b, dtype=torch.bool)
    untouched[sel] = False
    assert (got[untouched] == -1).all(), "a row not in spec was written"
    if scaled:  # never a masked token
        assert torch.isfinite(logits[torch.arange(len(rows)), got[sel]]).all()


def test_triton_kernels_in_interpreter() -> None:
    run_interp_tests_in_child(__file__, expected_passed=4)


# 300 / 64: 5 chunks, the last partial; 77 / 128: one partial chunk; 4099 / 1024: 5 chunks, 3 columns in
# the last; u = 0 (the first token of nonzero weight) and u = 0.999999 among the draws
@interp_only
@pytest.mark.parametrize(
    "b, v, chunk, scaled",
    [(5, 300, 64, False), (4, 1000, 256, True), (1, 77, 128, False), (6, 4099, 1024, False)],
)
def test_interp_sampling_equals_the_reference(b: int, v: int, chunk: int, scaled: bool) -> None:
    check_sampling(b, v, chunk, scaled, "cpu", margin=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("b, v, scaled", [(8, 163840, False), (3, 163840, True), (5, 1001, False)])
def test_gpu_sampling_equals_the_reference(b: int, v: int, scaled: bool) -> None:
    from k3run.kernels.sampling.triton import CHUNK

    check_sampling(b, v, CHUNK, scaled, "cuda", margin=1e-5)
