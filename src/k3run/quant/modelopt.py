"""ModelOpt quantization config: where it is read from, both of its JSON forms, and layer -> QuantAlgo.

The rules follow vLLM's ModelOpt config parsing (quantization/modelopt.py) so that a checkpoint means
the same thing here as in vLLM, with two deliberate tightenings, both raising instead of guessing:
- a fused layer whose shards resolve to different algorithms, including "quantized" next to "not listed",
  is an error (vLLM ignores unlisted shards, which would load a bf16 shard into an fp8 parameter);
- the legacy substring exclude rule is applied to single layers only, never to a fused name, so that an
  excluded router `mlp.gate` cannot swallow a fused `mlp.gate_up_proj`.

Layer prefixes are in checkpoint naming ("model.layers.3.self_attn.q_proj"); a config written under another
root ("language_model.model.", "model.language_model.", "model.", "layers.") or in the other naming (`mlp`
for `block_sparse_moe`, transformers 5's `self_attn.forget_gate.f_a_proj`, `experts.N.gate_proj` for
`experts.N.w1`) still matches, because both the exclude rules and the `quantized_layers` lookup try every
spelling of the prefix that the model's name table accepts (models/kimi.py `module_spellings`).

Routed experts run as one bank per MoE layer under one scheme, so a routed-expert projection
("...experts.5.w1") resolves as its bank ("...experts") does, in load_model and in `k3run inspect` alike.
"""

from __future__ import annotations

import bisect
import fnmatch
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeAlias

from k3run.quant.algo import QuantAlgo

if TYPE_CHECKING:
    from k3run.quant.compressed_tensors import CompressedTensorsConfig

MIXED_PRECISION = "MIXED_PRECISION"
HF_QUANT_CONFIG = "hf_quant_config.json"
NVFP4_GROUP_SIZE = 16
SUPPORTED_ALGOS = (
    QuantAlgo.FP8.value,
    QuantAlgo.FP8_PB_WO.value,
    QuantAlgo.NVFP4.value,
    QuantAlgo.W4A16_NVFP4.value,
    MIXED_PRECISION,
)

# vLLM names of fused layers that a caller may pass without shards (its hard-coded sibling lookup).
PACKED_SHARDS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
)

# Vision towers are never quantized by single-algorithm ModelOpt configs (vLLM hard-codes these names).
_VISION_PARTS = ("vision_tower", "vision_model", "vit_large_projector")


def name_variants(prefix: str) -> tuple[str, ...]:
    """Every spelling of a module prefix the model's name table accepts (models/kimi.py), `prefix` first."""
    from k3run.models.kimi import module_spellings  # the one name table; imported late (it imports layers)

    return module_spellings(prefix)


# a routed-expert projection: its bank, expert id and projection (either naming)
_EXPERT_PROJ = re.compile(r"^(?P<bank>.+\.experts)\.(?P<e>\d+)\.(?P<w>w[123]|gate_proj|up_proj|down_proj)$")
_EXPERT_CANON = {"w1": "w1", "w2": "w2", "w3": "w3", "gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def expert_bank(prefix: str) -> str | None:
    """The bank ("...experts") of a routed-expert projection prefix ("...experts.5.w1"), else None."""
    m = _EXPERT_PROJ.match(prefix)
    return m["bank"] if m else None


def _expand_pattern(pattern: str) -> tuple[str, ...]:
    """ModelOpt writes `X*` meaning "module X and its children"; a bare `*` would also match X's siblings
    (`*mlp.gate*` matching `mlp.gate_up_proj`), so it becomes `X` plus `X.*`, as vLLM rewrites it."""
    if len(pattern) >= 2 and pattern.endswith("*") and pattern[-2] != ".":
        return (pattern[:-1], pattern[:-1] + ".*")
    return (pattern,)


def _trie_regex(words: Sequence[str]) -> str:
    """One regex matching any of `words` with cost proportional to the text, not to len(words): the K3
    exclude list is long and is checked against ~10^5 expert names."""
    trie: dict[str, Any] = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}

    def emit(node: dict[str, Any]) -> str:
        alts = [re.escape(ch) + emit(child) for ch, child in sorted(node.items()) if ch]
        optional = "" in node
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        if optional:
            return "(?:" + body + ")?"
        return body

    return emit(trie)


def _nonempty_str(x: object) -> bool:
    return isinstance(x, str) and bool(x)


@dataclass(frozen=True)
class ModelOptConfig:
    """A parsed ModelOpt quantization config.

    quant_algo: the checkpoint-wide name, one of SUPPORTED_ALGOS ("MIXED_PRECISION" for per-layer configs).
    quantized_layers: MIXED_PRECISION only, every key as the config spells it -> its algorithm.
    group_size: NVFP4 block size (the first NVFP4 entry's for MIXED_PRECISION); always 16 for NVFP4.
    """

    quant_algo: str
    exclude_modules: tuple[str, ...] = ()
    quantized_layers: Mapping[str, QuantAlgo] = field(default_factory=lambda: MappingProxyType({}))
    group_size: int = NVFP4_GROUP_SIZE
    kv_cache_quant_algo: str | None = None
    producer: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.quant_algo not in SUPPORTED_ALGOS:
            raise ValueError(f"quant_algo {self.quant_algo!r} not one of {', '.join(SUPPORTED_ALGOS)}")
        if self.is_mixed and not self.quantized_layers:
            raise ValueError("quantized_layers: MIXED_PRECISION needs a non-empty quantized_layers map")
        object.__setattr__(self, "quantized_layers", MappingProxyType(dict(self.quantized_layers)))
        object.__setattr__(self, "exclude_modules", tuple(self.exclude_modules))

    def __hash__(self) -> int:
        # the generated hash would fail on the mapping fields; equal configs hash equal without them
        return hash((self.quant_algo, self.exclude_modules, len(self.quantized_layers), self.group_size))

    @property
    def is_mixed(self) -> bool:
        return self.quant_algo == MIXED_PRECISION

    def summary(self) -> str:
        """One line for `k3run inspect`: algorithm, producer, kv cache."""
        prod = dict(self.producer or {})
        by = f" by {prod.get('name')} {prod.get('version', '')}".rstrip() if prod else ""
        kv = f", kv cache {self.kv_cache_quant_algo}" if self.kv_cache_quant_algo else ""
        return f"ModelOpt {self.quant_algo}{by}{kv}"

    @property
    def algos(self) -> frozenset[QuantAlgo]:
        """Every algorithm some layer of this checkpoint may use."""
        if self.is_mixed:
            return frozenset(self.quantized_layers.values())
        return frozenset({QuantAlgo(self.quant_algo)})

    @cached_property
    def _patterns(self) -> tuple[str, ...]:
        return tuple(p for raw in self.exclude_modules for p in _expand_pattern(raw))

    @cached_property
    def _exact(self) -> frozenset[str]:
        return frozenset(self._patterns)

    @cached_property
    def _substring_re(self) -> re.Pattern[str] | None:
        words = [p for p in self._patterns if p]
        return re.compile(_trie_regex(words)) if words else None

    @cached_property
    def _glob_re(self) -> re.Pattern[str] | None:
        globs = [p for p in self._patterns if any(c in p for c in "*?[")]
        return re.compile("|".join(fnmatch.translate(g) for g in globs)) if globs else None

    @cached_property
    def _sorted_keys(self) -> tuple[str, ...]:
        return tuple(sorted(self.quantized_layers))

    @cached_property
    def _sorted_exact(self) -> tuple[str, ...]:
        return tuple(sorted(p for p in self._patterns if not any(c in p for c in "*?[")))

    def _excluded_name(self, name: str, *, substring: bool) -> bool:
        for cand in name_variants(name):
            if cand in self._exact:
                return True
            if self._glob_re is not None and self._glob_re.match(cand):
                return True
            sub = self._substring_re
            if substring and sub is not None:
                if sub.search(cand) or sub.search(cand.removeprefix("language_model.")):
                    return True
        return False

    def _bank_excluded(self, bank: str, num_experts: int | None) -> bool:
        """A bank is excluded when it (or a parent) is, or when the list names every projection of every
        one of its experts (k3run's exporter and ModelOpt write excluded modules by name); naming only some
        is an error, since a bank runs under one scheme. A glob or substring entry that matches expert 0's
        projections but not the bank is checked the same way over all experts."""
        if self._excluded_name(bank, substring=True):
            return True
        listed: set[tuple[int, str]] = set()
        for cand in name_variants(bank):
            start = cand + "."
            keys = self._sorted_exact
            i = bisect.bisect_left(keys, start)
            while i < len(keys) and keys[i].startswith(start):
                m = _EXPERT_PROJ.match(keys[i])
                if m is not None and m["bank"] == cand:
                    listed.add((int(m["e"]), _EXPERT_CANON[m["w"]]))
                i += 1
        if not listed:
            probe = [f"{bank}.0.{w}" for w in ("w1", "w2", "w3")]
            if not any(self._excluded_name(p, substring=True) for p in probe):
                return False
            n = num_experts if num_experts is not None else 1
            listed = {
                (e, w)
                for e in range(n)
                for w in ("w1", "w2", "w3")
                if self._excluded_name(f"{bank}.{e}.{w}", substring=True)
            }
        ids = range(num_experts) if num_experts is not None else sorted({e for e, _ in listed})
        want = {(e, w) for e in ids for w in ("w1", "w2", "w3")}
        if listed >= want:
            return True
        missing = sorted(want - listed)
        raise ValueError(
            f"Mixed quant_algo within fused layer {bank}: exclude_modules covers {len(listed & want)} of "
            f"the {len(want)} routed-expert projections (not e.g. expert {missing[0][0]} {missing[0][1]}); "
            "a bank runs under one scheme, so exclude all of its experts (or the bank) or none"
        )

    def is_excluded(self, prefix: str, shards: Sequence[str] = (), *, num_experts: int | None = None) -> bool:
        """Whether the exclude list keeps this layer unquantized (exact, legacy substring, or glob).

        A fused layer is excluded when it is listed itself (exactly or by a glob) or when all its shards
        are; shards that disagree raise ValueError. A routed-expert bank ("...experts") or one of its
        projections is excluded as the bank is (`_bank_excluded`; num_experts: the bank's expert count).
        """
        bank = expert_bank(prefix) or (prefix if prefix.endswith(".experts") else None)
        if bank is not None:
            return self._bank_excluded(bank, num_experts)
        shards = tuple(shards) or _default_shards(prefix)
        if not shards:
            return self._excluded_name(prefix, substring=True)
        if self._excluded_name(prefix, substring=False):
            return True
        flags = {s: self._excluded_name(s, substring=True) for s in shards}
        if all(flags.values()):
            return True
        if any(flags.values()):
            listing = ", ".join(f"{s}: {'excluded' if f else 'quantized'}" for s, f in flags.items())
            raise ValueError(f"Fused layer {prefix}: exclude_modules covers only some shards ({listing})")
        return False

    def _lookup(self, name: str) -> QuantAlgo | None:
        for cand in name_variants(name):
            algo = self.quantized_layers.get(cand)
            if algo is not None:
                return algo
        return None

    def _lookup_children(self, name: str) -> QuantAlgo | None:
        keys = self._sorted_keys
        found: dict[QuantAlgo, str] = {}
        for cand in name_variants(name):
            start = cand + "."
            i = bisect.bisect_left(keys, start)
            while i < len(keys) and keys[i].startswith(start):
                found.setdefault(self.quantized_layers[keys[i]], keys[i])
                i += 1
        if len(found) > 1:
            listing = ", ".join(f"{k}: {a.value}" for a, k in found.items())
            raise ValueError(f"Mixed quant_algo within fused layer {name}: its children use {listing}")
        return next(iter(found), None)

    def resolve(
        self, prefix: str, shards: Sequence[str] = (), *, num_experts: int | None = None
    ) -> QuantAlgo:
        """The algorithm of the layer at `prefix` (checkpoint naming); QuantAlgo.NONE when unquantized.

        shards: the full prefixes of the checkpoint layers a fused layer is built from, e.g. for
        "model.layers.0.self_attn.qkv_proj" the q/k/v prefixes. All shards must resolve to one algorithm,
        otherwise ValueError("Mixed quant_algo within fused layer ...").
        An experts bank (e.g. "...block_sparse_moe.experts", num_experts experts) takes the algorithm of the
        layers under it; a routed-expert projection ("...experts.5.w1") resolves as its bank.
        """
        bank = expert_bank(prefix)
        if bank is not None:
            return self.resolve(bank, num_experts=num_experts)
        shards = tuple(shards) or _default_shards(prefix)
        if self.is_excluded(prefix, shards, num_experts=num_experts):
            return QuantAlgo.NONE
        if not self.is_mixed:
            if any(part in prefix for part in _VISION_PARTS):
                return QuantAlgo.NONE
            return QuantAlgo(self.quant_algo)
        direct = self._lookup(prefix)
        if direct is not None:
            return direct
        if shards:
            per_shard = {s: self._lookup(s) or self._lookup_children(s) or QuantAlgo.NONE for s in shards}
            algos = set(per_shard.values())
            if len(algos) > 1:
                listing = ", ".join(f"{s}: {a.value}" for s, a in per_shard.items())
                raise ValueError(f"Mixed quant_algo within fused layer {prefix}: {listing}")
            return algos.pop()
        return self._lookup_children(prefix) or QuantAlgo.NONE


def _default_shards(prefix: str) -> tuple[str, ...]:
    parent, _, last = prefix.rpartition(".")
    names = PACKED_SHARDS.get(last, ())
    return tuple(f"{parent}.{s}" if parent else s for s in names)


def _parse_algo(value: object, where: str) -> str:
    if not _nonempty_str(value):
        raise ValueError(f"{where}: expected a quantization algorithm name, got {value!r}")
    key = str(value).strip().upper()
    if key not in SUPPORTED_ALGOS:
        supported = ", ".join(SUPPORTED_ALGOS)
        raise ValueError(f"{where}: unsupported quantization algorithm {value!r}; supported: {supported}")
    return key


def _parse_group_size(value: Any, where: str) -> int:
    """A JSON value as an int: what `int()` takes (an int, a numeric string), else a ValueError naming it."""
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: group_size must be an integer, got {value!r}") from None


def _parse_excludes(value: object, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise ValueError(f"{where}: the exclude list must be a list of strings, got {value!r}")
    return tuple(value)


def _parse_kv(value: object, where: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):
        # flat form: kv_cache_scheme {"type": "float", "num_bits": 8, ...} means FP8, anything else none
        return "FP8" if value.get("type") == "float" and value.get("num_bits") == 8 else None
    if not isinstance(value, str):
        raise ValueError(f"{where}: kv_cache_quant_algo must be a string or null, got {value!r}")
    return value.upper()


def parse_quant_config(qc: Mapping[str, Any], *, source: str = "quantization_config") -> ModelOptConfig:
    """Parse a ModelOpt config in either form.

    Legacy (hf_quant_config.json): {"producer": {...}, "quantization": {"quant_algo", "kv_cache_quant_algo",
    "group_size", "exclude_modules", ["quantized_layers"]}}.
    Flat (config.json quantization_config): {"quant_method": "modelopt*", "quant_algo", "ignore",
    "group_size", "kv_cache_scheme", "config_groups", ["quantized_layers"], "producer"}.
    """
    if not isinstance(qc, Mapping):
        raise ValueError(f"{source}: expected a JSON object, got {type(qc).__name__}")
    producer = qc.get("producer")
    if "quantization" in qc:
        where, body, algo, excludes, kv, config_groups = _legacy_form(qc, source)
    else:
        where, body, algo, excludes, kv, config_groups = _flat_form(qc, source)
    group_size = _parse_group_size(body.get("group_size", NVFP4_GROUP_SIZE), f"{where}.group_size")
    layers: dict[str, QuantAlgo] = {}
    if algo == MIXED_PRECISION:
        layers, group_size = _mixed_layers(body, where)
    elif algo == QuantAlgo.NVFP4 and isinstance(config_groups, Mapping) and config_groups:
        # vLLM reads NVFP4 without any activation quantization as weight-only NVFP4
        groups = config_groups.values()
        if all(not isinstance(g, Mapping) or g.get("input_activations") is None for g in groups):
            algo = QuantAlgo.W4A16_NVFP4.value
    uses_nvfp4 = algo in (QuantAlgo.NVFP4, QuantAlgo.W4A16_NVFP4) or any(
        a in (QuantAlgo.NVFP4, QuantAlgo.W4A16_NVFP4) for a in layers.values()
    )
    if uses_nvfp4 and group_size != NVFP4_GROUP_SIZE:
        raise ValueError(
            f"{where}.group_size: NVFP4 blocks are {NVFP4_GROUP_SIZE} elements, got {group_size}"
        )
    if producer is not None and not isinstance(producer, Mapping):
        raise ValueError(f"{source}.producer: expected an object, got {producer!r}")
    return ModelOptConfig(
        quant_algo=algo,
        exclude_modules=excludes,
        quantized_layers=layers,
        group_size=group_size,
        kv_cache_quant_algo=kv,
        producer=MappingProxyType(dict(producer)) if producer is not None else None,
    )


_Form = tuple[str, Mapping[str, Any], Any, Any, Any, Any]


def _legacy_form(qc: Mapping[str, Any], source: str) -> _Form:
    """hf_quant_config.json's {"producer", "quantization": {...}}: (where, body, algo, excludes, kv, None)."""
    body = qc["quantization"]
    if not isinstance(body, Mapping):
        raise ValueError(f"{source}.quantization: expected a JSON object, got {body!r}")
    where = f"{source}.quantization"
    algo = _parse_algo(body.get("quant_algo"), f"{where}.quant_algo")
    if algo == QuantAlgo.NVFP4:
        missing = [k for k in ("group_size", "kv_cache_quant_algo", "exclude_modules") if k not in body]
        if missing:
            raise ValueError(f"{where}: NVFP4 config lacks required key(s) {', '.join(missing)}")
    excludes = _parse_excludes(body.get("exclude_modules"), f"{where}.exclude_modules")
    kv = _parse_kv(body.get("kv_cache_quant_algo"), f"{where}.kv_cache_quant_algo")
    return where, body, algo, excludes, kv, None


def _flat_form(qc: Mapping[str, Any], source: str) -> _Form:
    """config.json's flat quantization_config: (where, body, algo, excludes, kv, config_groups)."""
    method = qc.get("quant_method")
    if not _nonempty_str(method) or not str(method).lower().startswith("modelopt"):
        raise ValueError(
            f"{source}.quant_method: expected modelopt, modelopt_fp4, modelopt_mixed or "
            f"compressed-tensors, got {method!r}"
        )
    algo = _parse_algo(qc.get("quant_algo"), f"{source}.quant_algo")
    excl_key = "ignore" if "ignore" in qc else "exclude_modules"
    excludes = _parse_excludes(qc.get(excl_key), f"{source}.{excl_key}")
    kv_raw = qc.get("kv_cache_scheme", qc.get("kv_cache_quant_algo"))
    kv = _parse_kv(kv_raw, f"{source}.kv_cache_scheme")
    return source, qc, algo, excludes, kv, qc.get("config_groups")


def _mixed_layers(body: Mapping[str, Any], where: str) -> tuple[dict[str, QuantAlgo], int]:
    """MIXED_PRECISION's quantized_layers: each layer's algorithm, and the group size of its first NVFP4
    layer (NVFP4_GROUP_SIZE when it has none)."""
    raw_layers = body.get("quantized_layers")
    if not isinstance(raw_layers, Mapping) or not raw_layers:
        raise ValueError(
            f"{where}.quantized_layers: MIXED_PRECISION needs a non-empty map, got {raw_layers!r}"
        )
    layers: dict[str, QuantAlgo] = {}
    group_size = NVFP4_GROUP_SIZE
    found_group = False
    for name, entry in raw_layers.items():
        at = f"{where}.quantized_layers[{name!r}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{at}: expected an object with quant_algo, got {entry!r}")
        layer_algo = _parse_algo(entry.get("quant_algo"), f"{at}.quant_algo")
        if layer_algo == MIXED_PRECISION:
            raise ValueError(f"{at}.quant_algo: a layer cannot be MIXED_PRECISION")
        layers[name] = QuantAlgo(layer_algo)
        if not found_group and layer_algo in (QuantAlgo.NVFP4, QuantAlgo.W4A16_NVFP4):
            group_size = _parse_group_size(entry.get("group_size", NVFP4_GROUP_SIZE), f"{at}.group_size")
            found_group = True
    return layers, group_size


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _load_hf_quant_config(model_dir: Path) -> ModelOptConfig:
    path = model_dir / HF_QUANT_CONFIG
    if not path.is_file():
        raise ValueError(
            f"{path}: missing; config.json's modelopt_mixed quantization_config has no quantized_layers"
        )
    data = _read_json(path)
    producer = data.get("producer")
    name = producer.get("name") if isinstance(producer, dict) else None
    if name != "modelopt":
        raise ValueError(f"{path}: producer.name must be 'modelopt', got {name!r}")
    return parse_quant_config(data, source=str(path))


def _is_mixed_without_layers(qc: Mapping[str, Any]) -> bool:
    body = qc.get("quantization", qc)
    if not isinstance(body, Mapping):
        return False
    method = str(qc.get("quant_method", "")).lower()
    algo = str(body.get("quant_algo", "")).upper()
    return (method == "modelopt_mixed" or algo == MIXED_PRECISION) and not body.get("quantized_layers")


def _method(qc: object) -> object:
    return qc.get("quant_method") if isinstance(qc, Mapping) else qc


# What `load_quant_config` returns for a quantized checkpoint: both resolve layers with the same calls
# (`resolve`, `is_excluded`, `explain`, `summary`, `algos`).
QuantConfig: TypeAlias = "ModelOptConfig | CompressedTensorsConfig"


def load_quant_config(
    source: str | Path | Mapping[str, Any], *, tensors: Mapping[str, Any] | None = None
) -> QuantConfig | None:
    """The ModelOpt config of a checkpoint directory (or of a parsed config.json dict); None if unquantized.

    Looks at config.json `quantization_config`, then `text_config.quantization_config`, then
    hf_quant_config.json (accepted only from producer "modelopt"); both config.json places given and different
    is an error. A modelopt_mixed quantization_config without quantized_layers defers to hf_quant_config.json,
    as vLLM does. quant_method "compressed-tensors" (moonshotai/Kimi-K3's MXFP4 experts) returns a
    quant/compressed_tensors.py `CompressedTensorsConfig`, which resolves layers the same way. Any other
    quant_method is an error rather than "unquantized". tensors: the checkpoint's safetensors headers, when
    the caller has read them already (compressed-tensors needs them, and reads them otherwise).
    """
    if isinstance(source, Mapping):
        model_dir, hf_config, where = None, dict(source), "config"
    else:
        model_dir = Path(source)
        cfg_path = model_dir / "config.json"
        hf_config = _read_json(cfg_path) if cfg_path.is_file() else {}
        where = str(cfg_path)
    qc = hf_config.get("quantization_config")
    key = "quantization_config"
    text_config = hf_config.get("text_config")
    inner = text_config.get("quantization_config") if isinstance(text_config, Mapping) else None
    if qc is not None and inner is not None and inner != qc:
        raise ValueError(
            f"{where}: quantization_config (quant_method {_method(qc)!r}) and "
            f"text_config.quantization_config (quant_method {_method(inner)!r}) contradict each other"
        )
    if qc is None and inner is not None:
        qc, key = inner, "text_config.quantization_config"
    if qc is not None:
        if not isinstance(qc, Mapping):
            raise ValueError(f"{where}: {key} must be an object, got {qc!r}")
        if qc.get("quant_method") == "compressed-tensors":
            from k3run.quant.compressed_tensors import load_compressed_tensors

            return load_compressed_tensors(qc, f"{where}: {key}", model_dir, tensors)
        if _is_mixed_without_layers(qc):
            if model_dir is None:
                raise ValueError(
                    f"{where}: {key} is modelopt_mixed without quantized_layers; pass the checkpoint "
                    f"directory so {HF_QUANT_CONFIG} can be read"
                )
            return _load_hf_quant_config(model_dir)
        return parse_quant_config(qc, source=f"{where}: {key}")
    if model_dir is not None and (model_dir / HF_QUANT_CONFIG).is_file():
        return _load_hf_quant_config(model_dir)
    return None
