"""Per-step state passed explicitly through the model (no module globals).

Dimension legend used in shape comments across k3run:
  T tokens in the flat batch, B sequences, S cache slots, D hidden, H heads (local to the TP rank),
  K key head dim, V value head dim, P = H*K, E experts, A active experts per token (top-k), L kv_lora_rank,
  R qk_rope_head_dim (the shared, un-rotated k_pe width), W conv kernel width.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch


@dataclass
class KDALayerCache:
    conv: torch.Tensor  # [S, 3P, W-1] the last W-1 pre-conv q|k|v projection outputs, activation dtype
    recurrent: torch.Tensor  # [S, H, K, V] fp32 delta-rule state (fla layout: key rows, value columns)


@dataclass
class MLALayerCache:
    latent: torch.Tensor  # [S, max_len, L + R] normalised latent c followed by k_pe, activation dtype


@dataclass
class ModelCache:
    """Per-layer cache tensors indexed by slot; built by the engine's cache manager (or by tests)."""

    layers: list[KDALayerCache | MLALayerCache | None]


@dataclass
class ForwardContext:
    """One forward step over a flat batch of B sequences.

    cu_seqlens: [B+1] int64 token offsets of each sequence in the flat [T, ...] inputs.
    context_lens: [B] int64 tokens each sequence already has in the cache before this step (0 for a fresh
      prefill); the new tokens of sequence b sit at positions context_lens[b] .. context_lens[b] + n_b - 1.
    slots: [B] int64 cache slot of each sequence, or None when running without a cache.
    cache: the cache, or None (then every sequence must start at 0 and nothing is stored).
    """

    cu_seqlens: torch.Tensor
    context_lens: torch.Tensor
    slots: torch.Tensor | None = None
    cache: ModelCache | None = None
    # host copies so layers can loop over sequences without device syncs
    seqlens_list: list[int] = field(default_factory=list)
    context_lens_list: list[int] = field(default_factory=list)
    slots_list: list[int] = field(default_factory=list)
    # static decode (a step that a CUDA graph captures once and replays, or torch.compile compiles with a
    # symbolic batch): every sequence feeds one token, B is cu_seqlens' length - 1 and seqlens_list stays
    # empty (a list of B ones would fix B in a compiled step); the device tensors above change between
    # replays but have no host copies, so layers read neither context_lens_list nor bounds(); MLA attends
    # over the first attn_window cached positions of each slot, masked by context_lens (every
    # context_lens[b] < attn_window). None: an ordinary step.
    attn_window: int | None = None
    # padded prefill (a step that a CUDA graph captures once per token bucket): ONE fresh sequence of n tokens
    # padded to T rows; cu_seqlens = [0, n, T] on the device (n changes between replays), rows n..T-1 are a
    # scratch sequence whose states and latents go to slots[1]; context_lens [2] zeros. Layers read no host
    # copy of per-step values (seqlens_list is [T, 0]: the rows only; bounds() and cu_seqlens_host() refuse).
    padded_prefill: bool = False
    _cu_host: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.padded_prefill:
            if self.attn_window is not None or self.cu_seqlens.numel() != 3 or self.slots is None:
                raise ValueError(
                    "ForwardContext: a padded prefill needs cu_seqlens [3] (one sequence and its padding), "
                    "slots [2] and no attn_window"
                )
            if len(self.seqlens_list) != 2 or self.seqlens_list[1] != 0:
                raise ValueError("ForwardContext: a padded prefill's seqlens_list is [rows, 0]")
            self.context_lens_list = [0, 0]  # both sequences start fresh
            self.slots_list = []  # never read in a padded prefill
            return
        if self.attn_window is not None:
            if self.attn_window < 1:
                raise ValueError(f"ForwardContext: attn_window must be >= 1, got {self.attn_window}")
            if self.seqlens_list:
                raise ValueError(
                    "ForwardContext: a static decode step takes no seqlens_list (B = len(cu_seqlens) - 1)"
                )
            self.context_lens_list = []  # never read in a static step
            return
        if not self.seqlens_list:
            self.seqlens_list = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()
        if not self.context_lens_list:
            self.context_lens_list = self.context_lens.tolist()
        if not self.slots_list and self.slots is not None:
            self.slots_list = self.slots.tolist()

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.shape[0] - 1 if self.is_static else len(self.seqlens_list)

    @property
    def num_tokens(self) -> int:
        """T from the host copies (no device read)."""
        return self.num_seqs if self.is_static else sum(self.seqlens_list)

    @property
    def is_static(self) -> bool:
        """A static decode step (see attn_window): device-only paths, no host reads of per-step values."""
        return self.attn_window is not None

    @property
    def sync_free(self) -> bool:
        """A step that a CUDA graph records or a compiled step runs (a static decode step or a padded
        prefill), and its eager warm-up: the routed experts take only paths that read nothing back from the
        device (`fused_experts`), so the warm-up compiles the kernels the capture records."""
        return self.is_static or self.padded_prefill

    def bounds(self) -> list[int]:
        """cu_seqlens as a host list, from seqlens_list (no device read)."""
        self._host_bounds_known()
        return [0, *itertools.accumulate(self.seqlens_list)]

    def cu_seqlens_host(self) -> torch.Tensor:
        """cu_seqlens as a CPU int64 tensor built from seqlens_list (no device read), the same object for
        every layer of the step (fla's chunk kernels take it instead of reading cu_seqlens back)."""
        self._host_bounds_known()
        if self._cu_host is None:
            self._cu_host = torch.tensor([0, *itertools.accumulate(self.seqlens_list)], dtype=torch.int64)
        return self._cu_host

    def _host_bounds_known(self) -> None:
        if self.padded_prefill or self.is_static:
            raise RuntimeError("a padded prefill or static decode step has no host copy of its bounds")

    @property
    def is_decode(self) -> bool:
        return self.is_static or all(n == 1 for n in self.seqlens_list)

    @classmethod
    def single(cls, num_tokens: int, device: torch.device | str = "cpu") -> ForwardContext:
        """One sequence, no cache: the `model.logits(input_ids)` case."""
        cu = torch.tensor([0, num_tokens], dtype=torch.int64, device=device)
        return cls(cu_seqlens=cu, context_lens=torch.zeros(1, dtype=torch.int64, device=device))
