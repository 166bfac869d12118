"""expert_groups (kernels/nvfp4_gemm/groups.py): the device-side table that groups a decode batch's routed
picks by expert for the expert-major NVFP4 launch, against its torch reference. Integer work only, so the
results must be identical. The kernel runs under the Triton interpreter in a child process (see
tests/interpreter_utils.py); on a GPU the by-expert GEMV test checks it again."""

from __future__ import annotations

import pytest
import torch

from k3run.kernels.nvfp4_gemm.groups import expert_groups_ref
from tests.interpreter_utils import interp_only, run_interp_tests_in_child


def _picks(t: int, a: int, n_ids: int, seed: int) -> torch.Tensor:
    """t tokens x a distinct ids from range(-2, n_ids - 2): some below 0 and some >= E (other ranks)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(n_ids, generator=g)[:a] - 2 for _ in range(t)]).reshape(-1)


def test_reference_groups_by_expert_in_order() -> None:
    ids = torch.tensor([3, 0, -1, 3, 7, 0, 2, 3])  # E = 4: 7 and -1 belong to no group
    grp = expert_groups_ref(ids, 4, 8)
    assert grp.shape == (4, 9) and grp.dtype == torch.int32
    assert grp[:, 0].tolist() == [0, 2, 3, -1]
    assert grp[0, 1:4].tolist() == [1, 5, -1] and grp[1, 1:3].tolist() == [6, -1]
    assert grp[2, 1:5].tolist() == [0, 3, 7, -1] and (grp[3] == -1).all()


def test_triton_kernel_in_interpreter() -> None:
    run_interp_tests_in_child(__file__, expected_passed=5)


@interp_only
@pytest.mark.parametrize(
    "t, a, e, bt",
    [(1, 16, 128, 8), (8, 16, 128, 8), (5, 4, 7, 8), (16, 16, 40, 16), (3, 2, 300, 8)],
)
def test_interp_expert_groups_matches_reference(t: int, a: int, e: int, bt: int) -> None:
    # (5, 4, 7): the expert block (8) is wider than E; (3, 2, 300): several expert blocks, few picks
    from k3run.kernels.nvfp4_gemm.groups import expert_groups

    ids = _picks(t, a, e + 5, seed=t * 1000 + e)
    assert torch.equal(expert_groups(ids, e, bt), expert_groups_ref(ids, e, bt))
