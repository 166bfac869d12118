"""expert_groups (kernels/nvfp4_gemm/groups.py): the device-side table that groups a decode batch's routed
picks by expert for the expert-major NVFP4 launch, against its torch reference. Integer work only, so the
results must be identical: the passes form's table bit for bit, the atomic form's up to the order of each
expert's picks over its groups (`same_groups`). The kernels run under the Triton interpreter in a child
process (see tests/interpreter_utils.py); on a GPU the by-expert GEMV test checks both again."""

from __future__ import annotations

import pytest
import torch

from k3run.kernels.nvfp4_gemm.groups import expert_groups_ref, same_groups
from k3run.knobs import override_knobs
from tests.interpreter_utils import interp_only, run_interp_tests_in_child

FORMS = ("passes", "atomic")


def test_same_groups_tells_order_from_content() -> None:
    """The comparison accepts another order of an expert's picks over its groups and rejects a moved pick,
    a gap in a row, another expert or another count."""
    ids = torch.tensor([1, 1, 0, 1, 1, 1, 2, 9, 0, 1, 2])
    want = expert_groups_ref(ids, 3, 2)  # rows: [0: 2, 8], [1: 0, 1], [1: 3, 4], [1: 5, 9], [2: 6, 10]
    shuffled = want.clone()
    shuffled[1, 1:], shuffled[3, 1:] = torch.tensor([9, 4]), torch.tensor([0, 5])
    shuffled[2, 1:] = torch.tensor([3, 1])
    assert same_groups(shuffled, want) and same_groups(want, want)
    moved = want.clone()
    moved[0, 1], moved[1, 1] = 0, 2  # a pick of expert 1 under expert 0
    gap = want.clone()
    gap[4, 1:] = torch.tensor([-1, 10])
    other = want.clone()
    other[4, 0] = 1
    short = want.clone()
    short[4, 2] = -1
    assert not any(same_groups(t, want) for t in (moved, gap, other, short))


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


def test_reference_splits_an_expert_over_groups_of_bt() -> None:
    """More than bt picks of one expert: groups of bt picks in order, the expert named in each; the table has
    max_groups rows (3 experts hit, 11 picks, bt 2: 3 + 8 // 2 = 7)."""
    from k3run.kernels.nvfp4_gemm.groups import max_groups

    ids = torch.tensor([1, 1, 0, 1, 1, 1, 2, 9, 0, 1, 2])
    grp = expert_groups_ref(ids, 3, 2)
    assert grp.shape == (max_groups(11, 3, 2), 3) == (7, 3)
    assert grp[:, 0].tolist() == [0, 1, 1, 1, 2, -1, -1]
    assert grp[:5, 1:].tolist() == [[2, 8], [0, 1], [3, 4], [5, 9], [6, 10]]


@pytest.mark.parametrize("picks, experts, bt", [(1, 1, 8), (16, 128, 8), (640, 64, 16), (7, 3, 2), (5, 9, 1)])
def test_max_groups_bounds_every_routing(picks: int, experts: int, bt: int) -> None:
    """max_groups is the exact worst case: no assignment of the picks needs more groups, and one (all experts
    hit, the rest of the picks on one expert) needs that many."""
    from k3run.kernels.nvfp4_gemm.groups import max_groups

    hit = min(picks, experts)
    counts = [1] * hit
    counts[0] += picks - hit
    worst = sum(-(-c // bt) for c in counts)
    assert max_groups(picks, experts, bt) == max(1, worst)
    g = torch.Generator().manual_seed(picks)
    for _ in range(50):
        ids = torch.randint(0, experts, (picks,), generator=g)
        used = sum(-(-int(c) // bt) for c in torch.bincount(ids, minlength=experts))
        assert used <= max_groups(picks, experts, bt)


def test_triton_kernel_in_interpreter() -> None:
    run_interp_tests_in_child(__file__, expected_passed=len(FORMS) * (8 + len(_SIZES)))


@interp_only
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    "t, a, e, bt",
    [
        (1, 16, 128, 8), (8, 16, 128, 8), (5, 4, 7, 8), (16, 16, 40, 16), (3, 2, 300, 8), (20, 4, 3, 8),
        (40, 16, 64, 16), (33, 8, 50, 8),
    ],
)  # fmt: skip
def test_interp_expert_groups_matches_reference(form: str, t: int, a: int, e: int, bt: int) -> None:
    # (5, 4, 7): the expert block (8) is wider than E; (3, 2, 300): several expert blocks, few picks;
    # t > bt: experts picked more than bt times get several groups
    from k3run.kernels.nvfp4_gemm.groups import expert_groups

    ids = _picks(t, a, e + 5, seed=t * 1000 + e)
    with override_knobs(moe_groups=form):
        got = expert_groups(ids, e, bt)
    want = expert_groups_ref(ids, e, bt)
    assert torch.equal(got, want) if form == "passes" else same_groups(got, want)


def _odd_picks(picks: int, experts: int, seed: int) -> list[torch.Tensor]:
    """Id vectors of `picks` picks over `experts` experts: random with repeats, some ids -1 or >= experts
    (other ranks' experts, also just past a power of two) and an int64 one past int32's range; one expert
    (the last, so the cumsum runs over all the others) taking every pick; the same with an invalid pick among
    them."""
    g = torch.Generator().manual_seed(seed)
    mixed = torch.randint(-1, experts + 3, (picks,), generator=g)
    mixed[torch.rand(picks, generator=g) < 0.1] = 2**32 + 1  # an int32 truncation would make it expert 1
    one = torch.full((picks,), experts - 1)
    one_bar_one = one.clone()
    one_bar_one[picks // 2] = experts + 17
    return [mixed.clamp(max=2**31 - 1).int(), mixed, one.int(), one_bar_one]


_SIZES = [(1, 1, 1), (7, 5, 2), (64, 256, 8), (100, 37, 16), (256, 256, 16), (300, 896, 8), (513, 64, 8)]


@interp_only
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("picks, experts, bt", _SIZES)
def test_interp_expert_groups_odd_ids_match_reference(form: str, picks: int, experts: int, bt: int) -> None:
    """The reference's bits at odd sizes (one pick, E and P not powers of two, several 64-pick chunks and
    expert blocks, more experts than picks) with other ranks' ids (-1, >= E, an int64 id past int32's range)
    and one expert taking every pick."""
    from k3run.kernels.nvfp4_gemm.groups import expert_groups

    for i, ids in enumerate(_odd_picks(picks, experts, seed=picks * 7919 + experts)):
        want = expert_groups_ref(ids, experts, bt)
        with override_knobs(moe_groups=form):
            got = expert_groups(ids, experts, bt)
        assert torch.equal(got, want) if form == "passes" else same_groups(got, want), (i, ids.dtype)
