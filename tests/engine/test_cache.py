"""Cache layout sizes, the start-up budget check, and slot allocation."""

from __future__ import annotations

import pytest
import torch

from k3run.config import ModelConfig
from k3run.engine.cache import (
    CacheBudgetError,
    CacheManager,
    KDAStateSpec,
    MLACacheSpec,
    build_cache_manager,
    cache_layout_for,
    plan_cache,
)
from k3run.forward_context import KDALayerCache, MLALayerCache

from .conftest import TOY_HF_CONFIG


def _layout(dtype: torch.dtype = torch.bfloat16):
    return cache_layout_for(ModelConfig.from_hf(TOY_HF_CONFIG), dtype)


def test_layout_follows_config_and_sizes_match_allocated_tensors() -> None:
    layout = _layout(torch.bfloat16)
    # toy config: layer 0 KDA (H 2, K = V = 4, W 4), layer 1 MLA (L 6 + R 2)
    assert layout.layers == (KDAStateSpec(2, 4, 4, 4), MLACacheSpec(8))
    max_len, slots = 40, 3
    cache = layout.allocate(slots, max_len, "cpu")
    kda, mla = cache.layers
    assert isinstance(kda, KDALayerCache) and isinstance(mla, MLALayerCache)
    assert kda.conv.shape == (slots, 3 * 8, 3) and kda.conv.dtype == torch.bfloat16
    assert kda.recurrent.shape == (slots, 2, 4, 4) and kda.recurrent.dtype == torch.float32
    assert mla.latent.shape == (slots, max_len, 8) and mla.latent.dtype == torch.bfloat16
    allocated = sum(t.numel() * t.element_size() for t in (kda.conv, kda.recurrent, mla.latent))
    assert layout.bytes_per_seq(max_len) * slots == allocated
    # by hand: conv 24*3*2 + state 2*4*4*4 = 272 bytes; latent 40*8*2 = 640 bytes
    assert layout.kda_bytes_per_seq() == 272 and layout.mla_bytes_per_seq(max_len) == 640


def test_tp_splits_kda_heads_only() -> None:
    cfg = ModelConfig.from_hf(TOY_HF_CONFIG)
    layout = cache_layout_for(cfg, torch.float32, tp_size=2)
    assert layout.layers == (KDAStateSpec(1, 4, 4, 4), MLACacheSpec(8))
    with pytest.raises(ValueError, match="not divisible by tp_size 4"):
        cache_layout_for(cfg, torch.float32, tp_size=4)


def test_budget_in_bytes_sets_the_slot_count() -> None:
    layout = _layout()
    per_seq = layout.bytes_per_seq(64)
    plan = plan_cache(layout, max_len=64, max_num_seqs=16, cache_bytes=int(2.5 * per_seq))
    assert plan.num_slots == 2 and plan.total_bytes == 2 * per_seq
    assert "2 sequences x 64 tokens" in plan.describe()
    # the sequence cap still applies when the bytes would allow more
    assert plan_cache(layout, max_len=64, max_num_seqs=3, cache_bytes=100 * per_seq).num_slots == 3


def test_budget_too_small_for_one_sequence_is_a_clear_error() -> None:
    layout = _layout()
    per_seq = layout.bytes_per_seq(64)
    with pytest.raises(
        CacheBudgetError, match=rf"cannot hold one sequence of 64 tokens, which needs {per_seq}"
    ):
        plan_cache(layout, max_len=64, max_num_seqs=4, cache_bytes=per_seq - 1)


def test_budget_larger_than_the_device_reports_what_fits() -> None:
    layout = _layout()
    per_seq = layout.bytes_per_seq(64)
    with pytest.raises(CacheBudgetError, match="it fits 3 such sequences"):
        plan_cache(layout, max_len=64, max_num_seqs=8, available_bytes=3 * per_seq + 5)
    # the real machine cannot hold 10^9 sequences of a K3-sized cache; the start-up check says so
    huge = cache_layout_for(ModelConfig.from_hf(TOY_HF_CONFIG), torch.float32)
    with pytest.raises(CacheBudgetError, match="MiB is available"):
        build_cache_manager(huge, device="cpu", max_len=1 << 20, max_num_seqs=1 << 30)


def test_slots_allocate_free_and_reset_kda_state() -> None:
    layout = _layout(torch.float32)
    mgr = CacheManager(layout, plan_cache(layout, max_len=16, max_num_seqs=3), "cpu")
    assert [mgr.allocate(), mgr.allocate()] == [0, 1] and mgr.num_free == 1
    kda = mgr.cache.layers[0]
    kda.conv[1].normal_()
    kda.recurrent[1].normal_()
    mgr.free(1)
    assert mgr.num_free == 2
    with pytest.raises(RuntimeError, match="freed twice"):
        mgr.free(1)
    assert mgr.allocate() == 1  # lowest free slot first, and it comes back clean
    assert kda.conv[1].abs().sum() == 0 and kda.recurrent[1].abs().sum() == 0
    mgr.allocate()
    with pytest.raises(RuntimeError, match="no free cache slot"):
        mgr.allocate()
