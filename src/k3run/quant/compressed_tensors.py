"""compressed-tensors quantization configs: the MXFP4 routed experts of moonshotai/Kimi-K3.

What is read (compressed-tensors' own rules, compressed_tensors/utils/match.py):
- `config_groups.<name>`: `targets` (a class name, "re:<regex>" matched with re.match against the module
  name, or an exact module name), `format` (else the top-level `format`), `weights`, `input_activations`.
- `ignore`: the same kinds of entries; an ignored module is unquantized.
- A module a group targets and `ignore` does not is quantized by that group.

Supported: `mxfp4-pack-quantized` (E2M1 codes in `weight_packed` uint8 [N, K/2], low nibble first, and one
E8M0 exponent per 32 elements in `weight_scale` uint8 [N, K/32]), weight-only, for routed experts; k3run
transcodes them losslessly to NVFP4 at load (formats/mxfp4.py) and runs its W4A16 NVFP4 expert kernels.
Everything else (other formats, activation quantization, MXFP4 linears outside the experts, kv-cache or
sparsity schemes, class targets other than "Linear") is refused with the field named.

The "Linear" class target: the published config targets "Linear" and ignores only the shared experts, while
its safetensors store every attention, router, latent-MoE and head weight as BF16 `.weight` (only the routed
experts have `weight_packed`). So when the checkpoint directory is known, a targeted layer stored as a plain
float `.weight` with no `weight_packed` is unquantized, and `notes()` says how many layers that covers; a
layer stored `weight_packed` that the config does not target (or ignores) is an error, as is a bank whose
experts are stored both ways.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from k3run.quant.algo import QuantAlgo
from k3run.quant.modelopt import _EXPERT_CANON, _EXPERT_PROJ, expert_bank, name_variants

QUANT_METHOD = "compressed-tensors"
MXFP4_FORMAT = "mxfp4-pack-quantized"
_PACKED = "packed"  # stored kind of a module with weight_packed
_FLOAT_CODES = ("BF16", "F16", "F32", "F64")
_CLASS_TARGETS = ("Linear",)
# weights args of MXFP4 and the values they must have (absent is fine: the format fixes the encoding)
_WEIGHT_ARGS: Mapping[str, tuple[Any, ...]] = {
    "num_bits": (4,),
    "group_size": (32,),
    "type": ("float",),
    "strategy": ("group",),
    "symmetric": (True,),
    "dynamic": (False,),
    "actorder": (None,),
    "block_structure": (None,),
    "scale_dtype": (None, "uint8", "torch.uint8", "float8_e8m0fnu", "torch.float8_e8m0fnu"),
    "zp_dtype": (None, "uint8", "torch.uint8"),
}
_WEIGHT_ARGS_IGNORED = ("observer", "observer_kwargs")  # calibration settings, nothing at inference
_TOP_LEVEL_NULL = ("kv_cache_scheme", "transform_config")


@dataclass(frozen=True)
class _Group:
    name: str
    targets: tuple[str, ...]
    format: str


def _fail(where: str, expected: str, got: object) -> ValueError:
    return ValueError(f"{where}: expected {expected}, got {got!r}")


def _check_entries(where: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(x, str) and x for x in value):
        raise _fail(where, "a list of module names, 're:' regexes or class names", value)
    for x in value:
        if x.startswith("re:"):
            try:
                re.compile(x[3:])
            except re.error as e:
                raise _fail(where, f"valid regexes ({e})", x) from None
        elif "." not in x and x[:1].isupper() and x not in _CLASS_TARGETS:
            raise _fail(where, f"class names k3run knows ({', '.join(_CLASS_TARGETS)})", x)
    return tuple(value)


def _parse_weights(where: str, weights: object) -> None:
    if not isinstance(weights, Mapping):
        raise _fail(where, "an object with the MXFP4 weight arguments", weights)
    unknown = sorted(set(weights) - set(_WEIGHT_ARGS) - set(_WEIGHT_ARGS_IGNORED))
    if unknown:
        raise _fail(where, f"only the keys {', '.join(_WEIGHT_ARGS)}", unknown)
    for key, allowed in _WEIGHT_ARGS.items():
        if key in weights and weights[key] not in allowed:
            val = weights[key]
            raise _fail(f"{where}.{key}", f"{' or '.join(repr(a) for a in allowed)} for {MXFP4_FORMAT}", val)


def parse_compressed_tensors(
    qc: Mapping[str, Any], *, source: str = "quantization_config", stored: Mapping[str, str] | None = None
) -> CompressedTensorsConfig:
    """Parse a compressed-tensors `quantization_config` (module doc for what is supported).

    stored: module prefix -> "packed" (has weight_packed) or the safetensors dtype of its `.weight`, from
    the checkpoint's headers (`stored_modules`); None when only the config is known.
    """
    if qc.get("quant_method") != QUANT_METHOD:
        raise _fail(f"{source}.quant_method", repr(QUANT_METHOD), qc.get("quant_method"))
    for key in _TOP_LEVEL_NULL:
        if qc.get(key) is not None:
            raise _fail(f"{source}.{key}", "null (k3run supports none)", qc[key])
    if qc.get("sparsity_config"):
        raise _fail(
            f"{source}.sparsity_config", "null or empty (k3run supports no sparsity)", qc["sparsity_config"]
        )
    top_format = qc.get("format")
    groups_raw = qc.get("config_groups")
    if not isinstance(groups_raw, Mapping) or not groups_raw:
        raise _fail(f"{source}.config_groups", "a non-empty object of quantization groups", groups_raw)
    groups = []
    for name, g in groups_raw.items():
        at = f"{source}.config_groups.{name}"
        if not isinstance(g, Mapping):
            raise _fail(at, "an object", g)
        fmt = g.get("format", top_format)
        if fmt != MXFP4_FORMAT:
            raise _fail(
                f"{at}.format", f"{MXFP4_FORMAT!r} (the only compressed-tensors format k3run reads)", fmt
            )
        for key in ("input_activations", "output_activations"):
            if g.get(key) is not None:
                raise _fail(f"{at}.{key}", f"null (k3run runs {MXFP4_FORMAT} weight-only)", g[key])
        _parse_weights(f"{at}.weights", g.get("weights"))
        targets = _check_entries(f"{at}.targets", g.get("targets"))
        groups.append(_Group(str(name), targets, fmt))
    ignore = _check_entries(f"{source}.ignore", qc.get("ignore", []))
    return CompressedTensorsConfig(
        groups=tuple(groups),
        ignore=ignore,
        source=source,
        stored=dict(stored) if stored is not None else None,
    )


def stored_modules(tensors: Mapping[str, Any]) -> dict[str, str]:
    """module prefix -> "packed" where `<prefix>.weight_packed` exists, else the dtype code of a 2-D
    `<prefix>.weight` (tensors: name -> TensorInfo from the safetensors headers)."""
    out: dict[str, str] = {}
    for name, info in tensors.items():
        prefix, _, last = name.rpartition(".")
        if last == "weight_packed":
            out[prefix] = _PACKED
        elif last == "weight" and len(info.shape) == 2 and prefix not in out:
            out[prefix] = info.dtype
    return out


def _matches(entry: str, names: Sequence[str]) -> bool:
    if entry in _CLASS_TARGETS:  # every layer k3run resolves is a Linear (or a bank of them)
        return True
    if entry.startswith("re:"):
        pattern = re.compile(entry[3:])
        return any(pattern.match(n) for n in names)
    return entry in names


@dataclass(frozen=True)
class CompressedTensorsConfig:
    """A parsed compressed-tensors config; resolves layers like ModelOptConfig (same call signatures)."""

    groups: tuple[_Group, ...]
    ignore: tuple[str, ...]
    source: str = "quantization_config"
    stored: Mapping[str, str] | None = None
    # layers resolved NONE because they are stored as plain float weights although a group targets them
    _stored_unquantized: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    quant_algo = QUANT_METHOD
    is_mixed = False
    producer = None
    kv_cache_quant_algo = None

    def __hash__(self) -> int:
        return hash((self.groups, self.ignore, self.source))

    @property
    def algos(self) -> frozenset[QuantAlgo]:
        return frozenset({QuantAlgo.MXFP4})

    def summary(self) -> str:
        return (
            f"compressed-tensors {MXFP4_FORMAT} (routed experts MXFP4 (compressed-tensors) -> NVFP4 "
            "transcode at load, lossless)"
        )

    def _ignored(self, names: Sequence[str]) -> bool:
        return any(_matches(e, names) for e in self.ignore)

    def _group(self, names: Sequence[str]) -> _Group | None:
        return next((g for g in self.groups if any(_matches(t, names) for t in g.targets)), None)

    def _stored(self, prefix: str) -> tuple[str | None, str | None]:
        """(checkpoint spelling, stored kind) of a module, or (None, None) if the headers do not have it."""
        if self.stored is None:
            return None, None
        for cand in name_variants(prefix):
            kind = self.stored.get(cand)
            if kind is not None:
                return cand, kind
        return None, None

    def _single(self, prefix: str) -> QuantAlgo:
        names = name_variants(prefix)
        quantized = not self._ignored(names) and self._group(names) is not None
        name, kind = self._stored(prefix)
        if kind == _PACKED and not quantized:
            why = "ignores it" if self._ignored(names) else "targets it in no group"
            raise ValueError(
                f"tensor {name}.weight_packed: stored MXFP4-packed, but {self.source} {why}; the checkpoint "
                "and its quantization config disagree"
            )
        if quantized and kind is not None and kind != _PACKED:
            self._stored_unquantized[name or prefix] = kind
            return QuantAlgo.NONE
        return QuantAlgo.MXFP4 if quantized else QuantAlgo.NONE

    @cached_property
    def _bank_members(self) -> dict[str, dict[tuple[int, str], tuple[str, str]]]:
        """Checkpoint bank spelling -> {(expert, w1|w2|w3): (checkpoint name, stored kind)} (headers)."""
        out: dict[str, dict[tuple[int, str], tuple[str, str]]] = defaultdict(dict)
        for name, kind in (self.stored or {}).items():
            m = _EXPERT_PROJ.match(name)
            if m is not None:
                out[m["bank"]][(int(m["e"]), _EXPERT_CANON[m["w"]])] = (name, kind)
        return dict(out)

    def _bank(self, bank: str, num_experts: int | None) -> QuantAlgo:
        want = self._bank_wanted(bank)
        if self.stored is None:
            return QuantAlgo.MXFP4 if want else QuantAlgo.NONE
        names = name_variants(bank)
        members = next((self._bank_members[n] for n in names if n in self._bank_members), {})
        if num_experts is not None and any(
            (e, w) not in members for e in range(num_experts) for w in ("w1", "w2", "w3")
        ):
            return QuantAlgo.MXFP4 if want else QuantAlgo.NONE  # the loader names the missing tensors
        return self._bank_stored(bank, members, want)

    def _bank_wanted(self, bank: str) -> bool:
        """Whether the config quantizes the bank's experts (expert 0's projections speak for the bank)."""
        names = name_variants(bank)
        probe = [name_variants(f"{bank}.0.{w}") for w in ("w1", "w2", "w3")]
        quantized = [not self._ignored(n) and self._group(n) is not None for n in probe]
        if len(set(quantized)) > 1 or self._ignored(names) and any(quantized):
            raise ValueError(
                f"Mixed quant_algo within fused layer {bank}: {self.source} quantizes some of its expert "
                "projections and not others; a bank runs under one scheme"
            )
        return quantized[0]

    def _bank_stored(
        self, bank: str, members: dict[tuple[int, str], tuple[str, str]], want: bool
    ) -> QuantAlgo:
        """The bank's algorithm from how its experts are stored (every expert present), against `want`."""
        kinds = {kind for _, kind in members.values()}
        if len(kinds) > 1 and _PACKED in kinds:
            packed = next(k for k, (_, v) in members.items() if v == _PACKED)
            plain = next(k for k, (_, v) in members.items() if v != _PACKED)
            raise ValueError(
                f"Mixed quant_algo within fused layer {bank}: expert {packed[0]} {packed[1]} is stored "
                f"weight_packed (MXFP4), expert {plain[0]} {plain[1]} as a plain weight; a bank runs under "
                "one scheme"
            )
        if kinds != {_PACKED}:
            if want and kinds:
                self._stored_unquantized[bank] = "/".join(sorted(kinds))
            return QuantAlgo.NONE
        if not want:
            raise ValueError(
                f"{bank}: its experts are stored weight_packed (MXFP4), but {self.source} does not "
                "quantize them (ignored or not targeted); the checkpoint and its config disagree"
            )
        # entries could single out experts by id: every expert's checkpoint name must be quantized too
        for (e, w), (name, _) in members.items():
            if self._ignored((name,)) or self._group((name,)) is None:
                raise ValueError(
                    f"Mixed quant_algo within fused layer {bank}: {self.source} leaves expert {e} {w} "
                    "unquantized but quantizes expert 0; a bank runs under one scheme"
                )
        return QuantAlgo.MXFP4

    def resolve(
        self, prefix: str, shards: Sequence[str] = (), *, num_experts: int | None = None
    ) -> QuantAlgo:
        """The algorithm of the layer at `prefix`: QuantAlgo.MXFP4 or QuantAlgo.NONE (module doc). A routed
        expert projection resolves as its bank; a fused layer's shards must agree."""
        bank = expert_bank(prefix)
        if bank is not None or prefix.endswith(".experts"):
            return self._bank(bank or prefix, num_experts)
        if not shards:
            return self._single(prefix)
        per_shard = {s: self._single(s) for s in shards}
        if len(set(per_shard.values())) > 1:
            listing = ", ".join(f"{s}: {a.value}" for s, a in per_shard.items())
            raise ValueError(f"Mixed quant_algo within fused layer {prefix}: {listing}")
        return next(iter(per_shard.values()))

    def is_excluded(self, prefix: str, shards: Sequence[str] = (), *, num_experts: int | None = None) -> bool:
        names = name_variants(expert_bank(prefix) or prefix)
        return self._ignored(names)

    def explain(self, prefix: str, algo: QuantAlgo, num_experts: int | None = None) -> str:
        """Why `prefix` resolved to `algo`, for error messages and inspect."""
        names = name_variants(expert_bank(prefix) or prefix)
        if algo is QuantAlgo.MXFP4:
            group = self._group(names) or self._group(name_variants(prefix))
            return f"{self.source}: config_groups.{group.name if group else '?'} ({MXFP4_FORMAT})"
        if self._ignored(names):
            return f"{self.source}: matched by the ignore list"
        if self._group(names) is None:
            return f"{self.source}: targeted by no config group"
        return f"{self.source}: targeted, but stored unquantized (a plain .weight, no weight_packed)"

    def notes(self) -> list[str]:
        """What resolution decided from the tensors rather than the config alone (after resolving)."""
        if not self._stored_unquantized:
            return []
        by_kind: dict[str, list[str]] = defaultdict(list)
        for name, kind in self._stored_unquantized.items():
            by_kind[kind].append(name)
        parts = [f"{len(v)} stored {k} (e.g. {sorted(v)[0]})" for k, v in sorted(by_kind.items())]
        return [
            f'{self.source}: layers its groups target ("Linear") but the checkpoint stores as plain float '
            f"weights without weight_packed load unquantized: {'; '.join(parts)}"
        ]


def load_compressed_tensors(
    qc: Mapping[str, Any], source: str, model_dir: Path | None, tensors: Mapping[str, Any] | None = None
) -> CompressedTensorsConfig:
    """Parse `qc`, with the stored kind of every module from the checkpoint's headers (`tensors`, or read
    from `model_dir`) when they are known (module doc: the "Linear" target)."""
    stored = None
    if tensors is None and model_dir is not None:
        from k3run.safetensors_io import read_checkpoint_headers

        tensors = read_checkpoint_headers(model_dir)
    if tensors is not None:
        stored = stored_modules(tensors)
    return parse_compressed_tensors(qc, source=source, stored=stored)
