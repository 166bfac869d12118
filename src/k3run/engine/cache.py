"""The cache manager: slot-based MLA latent cache and per-sequence KDA recurrent + conv state.

Every sequence admitted to the engine gets one slot S for its whole life. Slot s owns row s of every per-layer
tensor (see forward_context.py for the layouts), so a sequence's cache is allocated and freed as one integer.
The memory budget is fixed at start-up: either a byte budget or `max_num_seqs` sequences of `max_model_len`
tokens, and it is checked against what the device has before anything is allocated.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from k3run.config import ModelConfig
from k3run.forward_context import KDALayerCache, MLALayerCache, ModelCache

log = logging.getLogger(__name__)

MiB = 1 << 20


@dataclass(frozen=True)
class KDAStateSpec:
    """One KDA layer's per-sequence state: conv [3P, W-1] (activation dtype) and recurrent [H, K, V] fp32."""

    num_heads: int  # H, local to the TP rank
    head_k_dim: int  # K
    head_v_dim: int  # V
    conv_width: int  # W

    @property
    def conv_channels(self) -> int:
        # q and k have H*K channels, v has H*V; for Kimi K == V so this is 3P
        return self.num_heads * (2 * self.head_k_dim + self.head_v_dim)

    def bytes_per_seq(self, act_dtype: torch.dtype) -> int:
        conv = self.conv_channels * (self.conv_width - 1) * _itemsize(act_dtype)
        recurrent = self.num_heads * self.head_k_dim * self.head_v_dim * 4
        return conv + recurrent


@dataclass(frozen=True)
class MLACacheSpec:
    """One MLA layer's latent cache: [max_len, L + R] per sequence in the activation dtype."""

    latent_dim: int  # L + R

    def bytes_per_seq(self, act_dtype: torch.dtype, max_len: int) -> int:
        return max_len * self.latent_dim * _itemsize(act_dtype)


LayerSpec = KDAStateSpec | MLACacheSpec | None


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class CacheLayout:
    """What one sequence needs in every layer (None: the layer keeps no state)."""

    layers: tuple[LayerSpec, ...]
    act_dtype: torch.dtype

    def mla_bytes_per_seq(self, max_len: int) -> int:
        return sum(
            s.bytes_per_seq(self.act_dtype, max_len) for s in self.layers if isinstance(s, MLACacheSpec)
        )

    def kda_bytes_per_seq(self) -> int:
        return sum(s.bytes_per_seq(self.act_dtype) for s in self.layers if isinstance(s, KDAStateSpec))

    def bytes_per_seq(self, max_len: int) -> int:
        return self.mla_bytes_per_seq(max_len) + self.kda_bytes_per_seq()

    def allocate(self, num_slots: int, max_len: int, device: torch.device | str) -> ModelCache:
        layers: list[KDALayerCache | MLALayerCache | None] = []
        for spec in self.layers:
            if isinstance(spec, KDAStateSpec):
                conv = torch.zeros(
                    num_slots, spec.conv_channels, spec.conv_width - 1, dtype=self.act_dtype, device=device
                )
                rec = torch.zeros(
                    num_slots,
                    spec.num_heads,
                    spec.head_k_dim,
                    spec.head_v_dim,
                    dtype=torch.float32,
                    device=device,
                )
                layers.append(KDALayerCache(conv=conv, recurrent=rec))
            elif isinstance(spec, MLACacheSpec):
                latent = torch.zeros(num_slots, max_len, spec.latent_dim, dtype=self.act_dtype, device=device)
                layers.append(MLALayerCache(latent=latent))
            else:
                layers.append(None)
        return ModelCache(layers=layers)


class CacheBudgetError(ValueError):
    """The requested cache cannot be allocated (too small for one sequence, or larger than the device)."""


def available_memory_bytes(device: torch.device) -> int | None:
    """Free memory on `device` right now, or None when the platform does not say."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None
    return None


@dataclass(frozen=True)
class CachePlan:
    """The outcome of the start-up check: how many sequences of what length, and what that costs."""

    num_slots: int
    max_len: int
    bytes_per_seq: int
    mla_bytes_per_seq: int
    kda_bytes_per_seq: int

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.bytes_per_seq

    def describe(self) -> str:
        seqs = f"{self.num_slots} sequence{'' if self.num_slots == 1 else 's'}"
        return (
            f"cache: {seqs} x {self.max_len} tokens = {self.total_bytes / MiB:.2f} MiB "
            f"({self.bytes_per_seq / MiB:.3f} MiB per sequence: MLA latent "
            f"{self.mla_bytes_per_seq / MiB:.3f} MiB, KDA state {self.kda_bytes_per_seq / MiB:.3f} MiB)"
        )


def plan_cache(
    layout: CacheLayout,
    *,
    max_len: int,
    max_num_seqs: int,
    cache_bytes: int | None = None,
    available_bytes: int | None = None,
) -> CachePlan:
    """Decide the number of slots and check it fits.

    With `cache_bytes` the slot count is what fits in that many bytes (capped at `max_num_seqs`); without it,
    `max_num_seqs` slots. Either way the total must fit in `available_bytes` (when known).
    """
    if max_len < 2:
        raise CacheBudgetError(f"max_model_len must be >= 2 tokens, got {max_len}")
    if max_num_seqs < 1:
        raise CacheBudgetError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    per_seq = layout.bytes_per_seq(max_len)
    if cache_bytes is not None:
        if per_seq > cache_bytes:
            raise CacheBudgetError(
                f"cache budget of {cache_bytes} bytes ({cache_bytes / MiB:.2f} MiB) cannot hold one sequence "
                f"of {max_len} tokens, which needs {per_seq} bytes ({per_seq / MiB:.2f} MiB); raise the "
                f"budget or lower max_model_len"
            )
        num_slots = min(max_num_seqs, cache_bytes // per_seq) if per_seq > 0 else max_num_seqs
    else:
        num_slots = max_num_seqs
    plan = CachePlan(
        num_slots=num_slots,
        max_len=max_len,
        bytes_per_seq=per_seq,
        mla_bytes_per_seq=layout.mla_bytes_per_seq(max_len),
        kda_bytes_per_seq=layout.kda_bytes_per_seq(),
    )
    if available_bytes is not None and plan.total_bytes > available_bytes:
        fits = available_bytes // per_seq if per_seq > 0 else 0
        raise CacheBudgetError(
            f"the cache for {num_slots} sequences x {max_len} tokens needs {plan.total_bytes / MiB:.2f} MiB "
            f"but only {available_bytes / MiB:.2f} MiB is available (it fits {fits} such sequences)"
        )
    return plan


class CacheManager:
    """Owns the cache tensors and the free list of slots."""

    def __init__(self, layout: CacheLayout, plan: CachePlan, device: torch.device | str) -> None:
        self.layout = layout
        self.plan = plan
        self.device = torch.device(device)
        self.cache = layout.allocate(plan.num_slots, plan.max_len, self.device)
        # pop() hands out the lowest free slot first, which keeps tests and logs readable
        self._free: list[int] = list(range(plan.num_slots - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_slots(self) -> int:
        return self.plan.num_slots

    @property
    def max_len(self) -> int:
        return self.plan.max_len

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(
                "no free cache slot; the scheduler must not admit more than num_slots sequences"
            )
        slot = self._free.pop()
        self._used.add(slot)
        self._reset_slot(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise RuntimeError(f"cache slot {slot} freed twice or never allocated")
        self._used.remove(slot)
        self._free.append(slot)
        self._free.sort(reverse=True)

    def _reset_slot(self, slot: int) -> None:
        # a fresh sequence starts from a zero recurrent state and an all-zero conv history (the causal
        # padding); the MLA latent rows are only read below context_len, so they need no clearing
        for layer in self.cache.layers:
            if isinstance(layer, KDALayerCache):
                layer.conv[slot].zero_()
                layer.recurrent[slot].zero_()


def build_cache_manager(
    layout: CacheLayout,
    *,
    device: torch.device | str,
    max_len: int,
    max_num_seqs: int,
    cache_bytes: int | None = None,
) -> CacheManager:
    """Plan (with the device's free memory as the ceiling), log what fits, allocate."""
    dev = torch.device(device)
    avail = available_memory_bytes(dev)
    plan = plan_cache(
        layout, max_len=max_len, max_num_seqs=max_num_seqs, cache_bytes=cache_bytes, available_bytes=avail
    )
    log.info(plan.describe())
    return CacheManager(layout, plan, dev)


def cache_layout_for(config: ModelConfig, act_dtype: torch.dtype, tp_size: int = 1) -> CacheLayout:
    """Per-layer cache needs of a Kimi model; KDA heads split across TP ranks, the MLA latent does not."""
    if config.kda_num_heads % tp_size:
        raise ValueError(f"KDA num_heads {config.kda_num_heads} is not divisible by tp_size {tp_size}")
    specs: list[LayerSpec] = []
    for i in range(config.num_hidden_layers):
        if config.is_kda_layer(i):
            specs.append(
                KDAStateSpec(
                    num_heads=config.kda_num_heads // tp_size,
                    head_k_dim=config.kda_head_dim,
                    head_v_dim=config.kda_head_dim,
                    conv_width=config.conv_kernel_size,
                )
            )
        else:
            specs.append(MLACacheSpec(latent_dim=config.kv_lora_rank + config.qk_rope_head_dim))
    return CacheLayout(layers=tuple(specs), act_dtype=act_dtype)
