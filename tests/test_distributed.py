"""spawn_gloo's failure reporting: a rank's exception comes back with its traceback, a rank killed by a
signal comes back naming the signal and how far the ranks got."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from k3run.distributed import TPInfo, all_reduce
from tests.gloo import spawn_gloo


def _sum(tp: TPInfo) -> float:
    x = torch.tensor([float(tp.rank + 1)])
    all_reduce(x, tp)
    return x.item()


def _raise_on_rank1(tp: TPInfo) -> None:
    if tp.rank == 1:
        raise ValueError("rank one refuses")


def _abort_on_rank1(tp: TPInfo) -> int:
    if tp.rank == 1:
        os.abort()
    return tp.rank


def test_results_come_back_in_rank_order():
    assert spawn_gloo(_sum, 2) == [3.0, 3.0]


def test_a_rank_exception_carries_its_message():
    with pytest.raises(mp.ProcessRaisedException, match="rank one refuses"):
        spawn_gloo(_raise_on_rank1, 2)


def test_a_rank_killed_by_a_signal_is_named():
    signalled = r"process 1 terminated with signal SIGABRT; ranks that had written"
    with pytest.raises(RuntimeError, match=signalled):
        spawn_gloo(_abort_on_rank1, 2)
