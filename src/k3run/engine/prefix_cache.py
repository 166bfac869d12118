"""Prefix caching for the hybrid model: a prompt that starts with an earlier prompt's prefix skips it.

A Kimi model's cache is not made of independent per-token blocks: the KDA layers carry one recurrent and one
conv state per sequence, and those exist only at the position where a prefill chunk ended. So an entry is a
snapshot at one position n (a multiple of `block` tokens), taken when a prefill chunk ends exactly there:
- every MLA layer's latent rows [0, n) of the slot, copied;
- every KDA layer's conv and recurrent state after token n - 1, copied (the state at n, not at the end of
  whatever chunk came later: taking it anywhere else is the bug class that made SGLang's first hybrid prefix
  cache drop GSM8K from 0.895 to 0.150, sglang PR #31474).
The scheduler ends a prompt's prefill chunks at its snapshot points (`next_point`: block x 1, 2, 4, ... and
the last multiple of `block` below the prompt's length; at least one token stays to compute, so the first
output token has logits), and the engine stores a snapshot after each such step. On admission the longest
stored prefix of the new prompt (block hashes chained over the prompt, then the tokens compared) is copied
into the new slot and the prefill starts there.

Entries are copies, so a later step of the sequence they came from, or of anything that reuses its slot,
cannot change them; they are evicted least recently used past `capacity_bytes`. Requests that want prompt
log-probabilities skip the cache (the cached tokens are never computed). Every tensor-parallel rank runs the
same scheduler over its own shard, so the ranks agree on every hit and eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from k3run.engine.cache import CacheManager
from k3run.engine.sequence import Sequence
from k3run.forward_context import KDALayerCache, MLALayerCache

DEFAULT_BLOCK = 64


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    layers: list[tuple[torch.Tensor, ...] | None]  # per layer: (latent[:n],) or (conv, recurrent) or None
    nbytes: int


class PrefixCache:
    def __init__(self, cache: CacheManager, capacity_bytes: int, block: int = DEFAULT_BLOCK) -> None:
        if capacity_bytes <= 0 or block < 1:
            raise ValueError(f"prefix cache: capacity_bytes={capacity_bytes} and block={block} must be >= 1")
        self.cache = cache
        self.capacity = capacity_bytes
        self.block = block
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # key: chained hash of the blocks
        self.used_bytes = 0
        self.hits = 0
        self.lookups = 0
        self.hit_tokens = 0

    def boundary(self, seq: Sequence) -> int:
        """The prompt's last snapshot point: the last multiple of `block` below its length (0: none)."""
        return (len(seq.prompt_token_ids) - 1) // self.block * self.block

    def next_point(self, seq: Sequence, pos: int) -> int | None:
        """The first snapshot point after `pos`, or None. The points are block x 1, 2, 4, 8, ... and the
        last one: a later prompt that shares any prefix of this one reuses at least half of the shared
        part, and one that extends all of it (the next turn of a chat) reuses it all."""
        last = self.boundary(seq)
        p = self.block
        while p <= last:
            if p > pos:
                return p
            p *= 2
        return last if last > pos else None

    def is_point(self, seq: Sequence, pos: int) -> bool:
        last = self.boundary(seq)
        return 0 < pos <= last and (
            pos == last or (pos % self.block == 0 and (pos // self.block).bit_count() == 1)
        )

    def _keys(self, ids: list[int], blocks: int) -> list[int]:
        keys, h = [], 0
        for k in range(blocks):
            h = hash((h, tuple(ids[k * self.block : (k + 1) * self.block])))
            keys.append(h)
        return keys

    def restore(self, seq: Sequence) -> int:
        """Copy the longest stored prefix of seq's prompt into its slot; returns its length (0: none)."""
        n_blocks = self.boundary(seq) // self.block
        if n_blocks == 0 or seq.params.prompt_logprobs is not None or seq.slot is None:
            return 0
        self.lookups += 1
        ids = seq.prompt_token_ids
        keys = self._keys(ids, n_blocks)
        for k in reversed(range(n_blocks)):
            entry = self._entries.get(keys[k])
            n = (k + 1) * self.block
            if entry is None or entry.tokens != tuple(ids[:n]):
                continue
            self._entries.move_to_end(keys[k])
            for layer, saved in zip(self.cache.cache.layers, entry.layers):
                if isinstance(layer, MLALayerCache):
                    assert saved is not None
                    layer.latent[seq.slot, :n].copy_(saved[0])
                elif isinstance(layer, KDALayerCache):
                    assert saved is not None
                    layer.conv[seq.slot].copy_(saved[0])
                    layer.recurrent[seq.slot].copy_(saved[1])
            self.hits += 1
            self.hit_tokens += n
            return n
        return 0

    def store(self, seq: Sequence) -> None:
        """Snapshot seq's slot, which holds exactly its first num_cached tokens' state (a snapshot point)."""
        n = seq.num_cached
        if seq.slot is None or not self.is_point(seq, n):
            return
        key = self._keys(seq.prompt_token_ids, n // self.block)[-1]
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        layers: list[tuple[torch.Tensor, ...] | None] = []
        nbytes = 0
        for layer in self.cache.cache.layers:
            if isinstance(layer, MLALayerCache):
                saved: tuple[torch.Tensor, ...] | None = (layer.latent[seq.slot, :n].clone(),)
            elif isinstance(layer, KDALayerCache):
                saved = (layer.conv[seq.slot].clone(), layer.recurrent[seq.slot].clone())
            else:
                saved = None
            layers.append(saved)
            nbytes += sum(t.numel() * t.element_size() for t in saved or ())
        if nbytes > self.capacity:
            return
        while self.used_bytes + nbytes > self.capacity:
            _, old = self._entries.popitem(last=False)
            self.used_bytes -= old.nbytes
        self._entries[key] = _Entry(tuple(seq.prompt_token_ids[:n]), layers, nbytes)
        self.used_bytes += nbytes

    def __len__(self) -> int:
        return len(self._entries)
