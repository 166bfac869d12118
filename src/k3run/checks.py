"""Checkpoint checks shared by `load_model` and `k3run inspect`: what inspect accepts, loading accepts.

Three stages, cheapest first; every problem names the checkpoint tensor (never an internal parameter name),
and a contradiction with config.json names the config field and its value:

1. Headers only (`header_problems`): each tensor against the config (`config_problems`: the tensors a model
   with this config has and their shapes, each dimension tied to the config field it comes from; tensors it
   cannot use; missing ones) and against its layer's quantization scheme (quant/plan.py: dtypes, presence
   and shapes of the scales). Cost (this 2-core VM, shared with other work): 22 ms for the bundled model
   (944 tensors, bench/bench_checks.py); on synthetic headers with nvidia/Kimi-K3-NVFP4's real config,
   quant config, names and shapes (992,340 tensors, the release has 992,508; `--k3-headers`), 8 s for
   `config_problems` and 6 s for the layer checks (quant/plan.py resolves each expert bank once).
2. Scale values on the CPU (`scale_value_problems`): weight_scale / weight_scale_2 / input_scale read with a
   few large positioned reads (neighbouring tensors coalesced) and checked per format:
   - NVFP4 E4M3 block scales: NaN (0x7F / 0xFF) and negative values (sign bit set, magnitude > 0) are
     invalid. Zero (0x00, and -0 = 0x80) is accepted: it is a well-defined E4M3 value that decodes its
     16-element group to exact zeros (the kernels store such groups as zero codes), and a scale that
     underflows the E4M3 range is how an NVFP4 encoder without ModelOpt's clamp writes a group too small
     to represent. ModelOpt itself never writes 0 (it clamps at 2^-9 and writes 1.0 for an all-zero group;
     see tests/fixtures/README.md), so a zero scale loses nothing it wrote.
   - FP8_PB_WO fp32 128x128 block scales and every other floating scale (weight_scale_2, input_scale, FP8
     per-tensor scales): must be finite and > 0. An fp32 block scale cannot underflow for a tile with any
     nonzero value, and ModelOpt writes amax/448, or 1.0 for an all-zero tile, so 0 or a negative value
     is a corrupt file, and it would silently zero (or negate) a whole 128x128 tile.
   - MXFP4 E8M0 scales: 0xFF (the E8M0 NaN) is invalid.
   The loader checks the small ones (every fp32 scale) this way before it streams any weight; the E4M3
   block scales are 1/16 byte per weight (~1/9 of an NVFP4 checkpoint, ~170 GB of nvidia/Kimi-K3-NVFP4), so
   loading checks them on the device with the weights (stage 3), and only `inspect` reads them on the CPU.
3. Weights on the device after the copy (`screen_parameters`): one reduction per parameter that reads it
   once and allocates nothing (aminmax for floating weights, which is NaN if any element is NaN and +-inf
   if any is infinite; max over the bytes of FP8 weights and E4M3 scales), all results compared together and
   read back with ONE host sync per device. A flagged parameter is confirmed from the checkpoint: the tensors
   that feed it are read back on the CPU and checked exactly, which names the tensor, the value and its
   first offending index (and drops false alarms such as never-written padding rows). Packed E2M1 codes
   have no invalid byte and are not read.
   Cost, measured: the bundled model (248 parameters, 3.6 MiB read) 3 ms on one CPU thread (11-190 ms with
   two threads on this contended VM: thread-pool wake-ups). One H200 (screen_parameters over 8 GiB tensors,
   as bench/bench_checks.py --screen-gib 8 runs it): bf16 2.8 TB/s, fp8 weights 1.0 TB/s (two byte
   reductions), E4M3 scales 1.3 TB/s, and 28 us per parameter (6000 parameters in 168 ms: Python and one
   launch each), no extra memory.
   Estimate for nvidia/Kimi-K3-NVFP4 (1.61 TB: ~1.36 TB of packed codes, not read; ~170 GB of E4M3 block
   scales; ~80 GB of bf16 / fp8 / fp32) on H200s: 170 GB / 1.3 TB/s = 0.13 s + <= 80 GB / 1.0 TB/s = 0.08 s
   of reading, over the GPUs that hold them (TP8: ~0.03 s each), plus ~3000 parameters per rank x 28 us =
   0.08 s: ~0.1 s per rank, against minutes to read 1.6 TB from disk.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from k3run.loader import LoadError, _data_start
from k3run.models.kimi import _IGNORED, _MOE_RENAME, _ROOTS, _strip_root

if TYPE_CHECKING:
    from k3run.config import ModelConfig
    from k3run.safetensors_io import TensorInfo

MAX_LISTED = 20  # problems listed one per line; the rest are counted
SCALE_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale")
BLOCK_SCALE_CODES = ("F8_E4M3", "F8_E8M0")  # one byte per 16 / 32 weights: the bulky scales
_FLOAT_CODES = ("BF16", "F16", "F32")
_COALESCE_GAP = 1 << 20  # neighbouring scale tensors at most this far apart are read with one pread
_READ_BATCH = 64 << 20  # ... up to this many bytes per read


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint, as one line. Problems of one `group` (the config field they
    contradict) are folded into one line when listed."""

    message: str
    group: str | None = None
    tensor: str | None = None  # the checkpoint tensor it is about, where there is one


class CheckpointInvalid(LoadError):
    """A checkpoint refused before (or while) loading; `problems` lists everything found."""

    def __init__(self, where: str | Path, problems: Sequence[Problem]) -> None:
        self.where = str(where)
        self.problems = list(problems)
        lines = self.lines()
        n = len(self.problems)
        head = f"{self.where}: checkpoint refused, {n} problem{'' if n == 1 else 's'}"
        super().__init__(f"{head}: " + "; ".join(lines))

    def lines(self, limit: int = MAX_LISTED) -> list[str]:
        """One line per problem (a config field's contradictions folded into one), at most `limit`."""
        folded: list[str] = []
        counts = Counter(p.group for p in self.problems if p.group is not None)
        seen: set[str] = set()
        for p in self.problems:
            if p.group is None:
                folded.append(p.message)
            elif p.group not in seen:
                seen.add(p.group)
                more = counts[p.group] - 1
                tail = (
                    f" (and {more} more tensor{'s' if more > 1 else ''} disagreeing with it)" if more else ""
                )
                folded.append(p.message + tail)
        if len(folded) > limit:
            folded = [*folded[:limit], f"... and {len(folded) - limit} more problems"]
        return folded


# ----------------------------------------------------------------------------------------------------------
# 1. headers against the config


@dataclass(frozen=True)
class Dim:
    """One expected dimension: its size and the config field(s) it derives from (empty: a constant)."""

    size: int
    field: str = ""
    expr: str = ""  # the values behind a composite field, e.g. "2 * 128"

    def __mul__(self, other: Dim) -> Dim:
        def par(s: str) -> str:
            return f"({s})" if " + " in s else s

        field = f"{par(self.name)} * {par(other.name)}"
        return Dim(self.size * other.size, field, f"{par(self.value)} * {par(other.value)}")

    def __add__(self, other: Dim) -> Dim:
        return Dim(self.size + other.size, f"{self.name} + {other.name}", f"{self.value} + {other.value}")

    @property
    def name(self) -> str:
        return self.field or str(self.size)  # a constant stands for itself in a composite

    @property
    def value(self) -> str:
        return self.expr or str(self.size)

    def says(self) -> str:
        """'config hidden_size = 128', 'config a * b = 2 * 128 = 256'."""
        return f"config {self.field} = " + (f"{self.expr} = {self.size}" if self.expr else str(self.size))


@dataclass(frozen=True)
class Expected:
    """A tensor a model with this config has: the accepted shapes (the first one is canonical; for linear
    weights the logical [N, K]) and the config setting that makes it exist (None: every model has it)."""

    shapes: tuple[tuple[Dim, ...], ...]
    because: str | None = None
    linear: bool = False  # a linear layer's weight, possibly quantized (NVFP4 packs two codes per byte)
    alternative: str | None = None  # conv weights: a layer has either q/k/v_conv1d or the fused conv1d


class _Fields:
    """Config fields by their JSON spelling in this config.json (Moonshot's or transformers-5's, under
    `text_config.` for the kimi_k3 wrapper)."""

    KEYS: Mapping[str, tuple[str, ...]] = {
        "vocab_size": ("vocab_size",),
        "hidden_size": ("hidden_size",),
        "num_hidden_layers": ("num_hidden_layers",),
        "intermediate_size": ("intermediate_size",),
        "kda_num_heads": ("linear_attn_config.num_heads", "linear_num_heads"),
        "kda_head_dim": ("linear_attn_config.head_dim", "linear_head_dim"),
        "conv_kernel_size": ("linear_attn_config.short_conv_kernel_size", "linear_conv_kernel_dim"),
        "kda_layers": ("linear_attn_config.kda_layers", "layer_types"),
        "use_full_rank_gate": ("use_full_rank_gate", "linear_attn_config.use_full_rank_gate"),
        "num_attention_heads": ("num_attention_heads",),
        "q_lora_rank": ("q_lora_rank",),
        "kv_lora_rank": ("kv_lora_rank",),
        "qk_nope_head_dim": ("qk_nope_head_dim",),
        "qk_rope_head_dim": ("qk_rope_head_dim",),
        "v_head_dim": ("v_head_dim",),
        "mla_use_output_gate": ("mla_use_output_gate",),
        "num_experts": ("num_experts", "num_local_experts"),
        "moe_layers": ("first_k_dense_replace", "mlp_layer_types"),
        "moe_intermediate_size": ("moe_intermediate_size",),
        "num_shared_experts": ("num_shared_experts", "n_shared_experts"),
        "routed_expert_hidden_size": ("routed_expert_hidden_size",),
        "latent_moe_use_norm": ("latent_moe_use_norm",),
        "attn_res_block_size": ("attn_res_block_size",),
        "tie_word_embeddings": ("tie_word_embeddings",),
    }

    def __init__(self, hf: Mapping[str, Any], cfg: ModelConfig) -> None:
        wrapped = hf.get("model_type") == "kimi_k3" and isinstance(hf.get("text_config"), Mapping)
        self.text: Mapping[str, Any] = hf["text_config"] if wrapped else hf
        self.head = "text_config." if wrapped else ""
        self.cfg = cfg

    def _present(self, key: str) -> bool:
        node: Any = self.text
        for part in key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return False
            node = node[part]
        return True

    def name(self, attr: str) -> str:
        keys = self.KEYS[attr]
        return self.head + next((k for k in keys if self._present(k)), keys[0])

    def dim(self, attr: str) -> Dim:
        return Dim(int(getattr(self.cfg, attr)), self.name(attr))

    def setting(self, attr: str, value: object | None = None) -> str:
        v = getattr(self.cfg, attr) if value is None else value
        return f"config {self.name(attr)} = {json.dumps(v)}"


def _lin(n: Dim, k: Dim, because: str | None = None) -> Expected:
    return Expected(((n, k),), because, linear=True)


def _vec(n: Dim, because: str | None = None) -> Expected:
    return Expected(((n,),), because)


def expected_tensors(cfg: ModelConfig, f: _Fields) -> dict[str, Expected]:
    """Every tensor of a model with this config, by canonical name (`_canonical`), with its shapes."""
    D, one = f.dim("hidden_size"), Dim(1)
    out: dict[str, Expected] = {
        "embed_tokens.weight": Expected(((f.dim("vocab_size"), D),)),
        "norm.weight": _vec(D),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = _lin(f.dim("vocab_size"), D, f.setting("tie_word_embeddings", False))
    res = f.setting("attn_res_block_size") if cfg.uses_attn_res else None
    if cfg.uses_attn_res:
        out["output_attn_res_norm.weight"] = _vec(D, res)
        out["output_attn_res_proj.weight"] = Expected(((one, D),), res)
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        out[p + "input_layernorm.weight"] = _vec(D)
        out[p + "post_attention_layernorm.weight"] = _vec(D)
        if cfg.uses_attn_res:
            for site in ("self_attention_res", "mlp_res"):
                out[f"{p}{site}_norm.weight"] = _vec(D, res)
                out[f"{p}{site}_proj.weight"] = Expected(((one, D),), res)
        out.update(_mixer_tensors(cfg, f, i))
        out.update(_mlp_tensors(cfg, f, i))
    return out


def _mixer_tensors(cfg: ModelConfig, f: _Fields, i: int) -> dict[str, Expected]:
    p = f"layers.{i}.self_attn."
    D = f.dim("hidden_size")
    out: dict[str, Expected] = {}
    if cfg.is_kda_layer(i):
        why = f"config {f.name('kda_layers')}: layer {i} (0-indexed) is a KDA layer"
        H, K, W = f.dim("kda_num_heads"), f.dim("kda_head_dim"), f.dim("conv_kernel_size")
        P = H * K
        for name in ("q_proj", "k_proj", "v_proj"):
            out[f"{p}{name}.weight"] = _lin(P, D, why)
        out[p + "b_proj.weight"] = _lin(H, D, why)
        out[p + "f_a_proj.weight"] = _lin(K, D, why)
        out[p + "f_b_proj.weight"] = _lin(P, K, why)
        if cfg.use_full_rank_gate:
            out[p + "g_proj.weight"] = _lin(P, D, f.setting("use_full_rank_gate"))
        else:
            out[p + "g_a_proj.weight"] = _lin(K, D, f.setting("use_full_rank_gate"))
            out[p + "g_b_proj.weight"] = _lin(P, K, f.setting("use_full_rank_gate"))
        out[p + "o_proj.weight"] = _lin(D, P, why)
        out[p + "o_norm.weight"] = _vec(K, why)
        # A_log: [H], the legacy [1, 1, H, 1], or K3's release layout padded with zeros to [head_dim]
        a_log = [(H,), (Dim(1), Dim(1), H, Dim(1))] + ([(K,)] if K.size > H.size else [])
        out[p + "A_log"] = Expected(tuple(a_log), why)
        out[p + "dt_bias"] = _vec(P, why)
        for qkv in "qkv":
            out[f"{p}{qkv}_conv1d.weight"] = Expected(((P, Dim(1), W), (P, W)), why, alternative="fused")
        out[p + "conv1d.weight"] = Expected(
            ((Dim(3) * P, Dim(1), W), (Dim(3) * P, W)), why, alternative="split"
        )
        return out
    why = f"config {f.name('kda_layers')}: layer {i} (0-indexed) is a full-attention (MLA) layer"
    nh = f.dim("num_attention_heads")
    nope, rope, v = f.dim("qk_nope_head_dim"), f.dim("qk_rope_head_dim"), f.dim("v_head_dim")
    kv = f.dim("kv_lora_rank")
    if cfg.q_lora_rank is not None:
        q = f.dim("q_lora_rank")
        out[p + "q_a_proj.weight"] = _lin(q, D, f.setting("q_lora_rank"))
        out[p + "q_a_layernorm.weight"] = _vec(q, f.setting("q_lora_rank"))
        out[p + "q_b_proj.weight"] = _lin(nh * (nope + rope), q, f.setting("q_lora_rank"))
    else:
        out[p + "q_proj.weight"] = _lin(nh * (nope + rope), D, f.setting("q_lora_rank"))
    out[p + "kv_a_proj_with_mqa.weight"] = _lin(kv + rope, D, why)
    out[p + "kv_a_layernorm.weight"] = _vec(kv, why)
    out[p + "kv_b_proj.weight"] = _lin(nh * (nope + v), kv, why)
    if cfg.mla_use_output_gate:
        out[p + "g_proj.weight"] = _lin(nh * v, D, f.setting("mla_use_output_gate"))
    out[p + "o_proj.weight"] = _lin(D, nh * v, why)
    return out


def _mlp_tensors(cfg: ModelConfig, f: _Fields, i: int) -> dict[str, Expected]:
    p = f"layers.{i}.mlp."
    D = f.dim("hidden_size")
    out: dict[str, Expected] = {}
    if not cfg.is_moe_layer(i):
        inter = f.dim("intermediate_size")
        why = f"config {f.name('moe_layers')}: layer {i} (0-indexed) is a dense MLP layer"
        out[p + "gate_proj.weight"] = _lin(inter, D, why)
        out[p + "up_proj.weight"] = _lin(inter, D, why)
        out[p + "down_proj.weight"] = _lin(D, inter, why)
        return out
    why = f"config {f.name('moe_layers')}: layer {i} (0-indexed) is a MoE layer"
    E, inter = f.dim("num_experts"), f.dim("moe_intermediate_size")
    out[p + "gate.weight"] = Expected(((E, D),), why)
    out[p + "gate.e_score_correction_bias"] = _vec(E, why)
    width = D
    if cfg.routed_expert_hidden_size is not None:
        width = f.dim("routed_expert_hidden_size")
        latent = f.setting("routed_expert_hidden_size")
        out[p + "routed_expert_down_proj.weight"] = _lin(width, D, latent)
        out[p + "routed_expert_up_proj.weight"] = _lin(D, width, latent)
        if cfg.latent_moe_use_norm:
            out[p + "routed_expert_norm.weight"] = _vec(width, f.setting("latent_moe_use_norm"))
    experts = f"{f.setting('num_experts')}; {why.removeprefix('config ')}"
    for e in range(int(cfg.num_experts or 0)):
        q = f"{p}experts.{e}."
        out[q + "w1.weight"] = _lin(inter, width, experts)
        out[q + "w3.weight"] = _lin(inter, width, experts)
        out[q + "w2.weight"] = _lin(width, inter, experts)
    if cfg.num_shared_experts:
        shared = inter * f.dim("num_shared_experts")
        because = f.setting("num_shared_experts")
        out[p + "shared_experts.gate_proj.weight"] = _lin(shared, D, because)
        out[p + "shared_experts.up_proj.weight"] = _lin(shared, D, because)
        out[p + "shared_experts.down_proj.weight"] = _lin(D, shared, because)
    return out


_EXPERT_SHARD = re.compile(r"(\.experts\.\d+\.)(gate_proj|up_proj|down_proj)(?=\.)")
_SHARD_W = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_W_SHARD = {v: k for k, v in _SHARD_W.items()}
_FORGET_GATE = re.compile(r"(\.self_attn\.)forget_gate\.")
_FORGET_GATE_PARTS = ("f_a_proj", "f_b_proj", "A_log", "dt_bias")
_LAYER = re.compile(r"^layers\.(\d+)\.")
_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def _canonical(name: str) -> str | None:
    """A checkpoint name under both namings as one key: root stripped (models/kimi.py's rules), `mlp` for
    `block_sparse_moe`, no `forget_gate.`, experts' w1/w2/w3; None when the name has no known root."""
    core = _strip_root(name)
    if core is None:
        return None
    core = _MOE_RENAME.sub("mlp", core)
    core = _FORGET_GATE.sub(r"\1", "." + core)[1:] if ".forget_gate." in f".{core}" else core
    return _EXPERT_SHARD.sub(lambda m: m.group(1) + _SHARD_W[m.group(2)], core)


class _Style:
    """How this checkpoint spells names, to name a missing tensor the way its neighbours are named."""

    def __init__(self, names: Iterable[str]) -> None:
        roots: Counter[str] = Counter()
        self.moe = self.forget_gate = self.hf_experts = self.fused_conv = False
        for n in names:
            roots[next((r for r in _ROOTS if n.startswith(r)), "")] += 1
            self.moe |= ".block_sparse_moe." in n
            self.forget_gate |= ".forget_gate." in n
            self.hf_experts |= bool(_EXPERT_SHARD.search(n))
            self.fused_conv |= n.endswith(".self_attn.conv1d.weight")
        self.root = roots.most_common(1)[0][0] if roots else "model."
        self.lm_head = "language_model.lm_head." if self.root == "language_model.model." else "lm_head."

    def render(self, key: str, moe_layer: bool) -> str:
        if key.startswith("lm_head."):
            return self.lm_head + key[len("lm_head.") :]
        if self.moe and moe_layer:
            key = key.replace(".mlp.", ".block_sparse_moe.", 1)
        if self.forget_gate:
            for part in _FORGET_GATE_PARTS:
                key = key.replace(f".self_attn.{part}", f".self_attn.forget_gate.{part}", 1)
        if self.hf_experts:
            key = re.sub(
                r"(\.experts\.\d+\.)(w[123])(?=\.)", lambda m: m.group(1) + _W_SHARD[m.group(2)], key
            )
        return self.root + key


def _logical_shape(info: TensorInfo, exp: Expected) -> tuple[int, ...]:
    if exp.linear and info.dtype == "U8" and len(info.shape) == 2:
        return (info.shape[0], 2 * info.shape[1])  # packed E2M1: two codes per byte
    return info.shape


def _shape_problem(name: str, info: TensorInfo, exp: Expected) -> Problem | None:
    actual = _logical_shape(info, exp)
    if any(actual == tuple(d.size for d in s) for s in exp.shapes):
        return None
    ref = next((s for s in exp.shapes if len(s) == len(actual)), exp.shapes[0])
    want = [d.size for d in exp.shapes[0]]
    packed = f" (packed E2M1, logical {list(actual)})" if actual != info.shape else ""
    has = f"tensor {name} has shape {list(info.shape)}{packed}"
    if len(ref) == len(actual):
        for d, n in zip(ref, actual, strict=True):
            if d.size != n and d.field:
                return Problem(f"{d.says()} but {has}; expected {want}", group=d.field, tensor=name)
    return Problem(f"{has}; expected {want}", tensor=name)


def config_problems(
    hf: Mapping[str, Any], cfg: ModelConfig, tensors: Mapping[str, TensorInfo]
) -> list[Problem]:
    """The checkpoint's tensor names and shapes against what a model with config `hf` / `cfg` has.

    Reports, in checkpoint names: shapes contradicting a config field (naming the field and its value),
    tensors the model cannot use (naming the config field that rules them out where one does), missing
    tensors (with the config setting that asks for them), and non-float dtypes of unquantized vectors.
    Scale tensors of an expected linear layer are left to the layer checks (quant/plan.py)."""
    f = _Fields(hf, cfg)
    expected = expected_tensors(cfg, f)
    flipped: dict[int, list[tuple[str, str, set[str]]]] = {}
    shapes: list[Problem] = []
    extra: list[Problem] = []
    seen: set[str] = set()
    for name in sorted(tensors, key=_natural):
        if _IGNORED.match(name):
            continue
        key = _expected_key(name, cfg, expected)
        if key is None:
            extra.append(
                Problem(f"tensor {name}: not a Kimi text-decoder name (no known root), not used", tensor=name)
            )
        elif key == "":
            continue  # read elsewhere or not at all (a tied head's copy, a linear's scale)
        elif key not in expected:
            extra.append(_unused(name, key, cfg, f, flipped))
        else:
            seen.add(key)
            shapes.extend(_tensor_problems(name, tensors[name], expected[key]))
    return shapes + extra + _missing(expected, seen, cfg, _Style(tensors))


def _expected_key(name: str, cfg: ModelConfig, expected: Mapping[str, Expected]) -> str | None:
    """The canonical key a checkpoint tensor is checked as; None for a name of no known root, "" for one
    that is not checked here (lm_head when tied: the logits use embed_tokens; a scale of an expected linear:
    the layer checks in quant/plan.py decide whether its scheme has it)."""
    key = _canonical(name)
    if key is None:
        return None
    base, _, suffix = key.rpartition(".")
    if key.startswith("lm_head.") and cfg.tie_word_embeddings:
        return ""
    if suffix == "weight_packed":  # compressed-tensors (MXFP4 experts): the packed codes are the weight
        key = base + ".weight"
    if key not in expected and suffix in SCALE_SUFFIXES:
        owner = expected.get(base + ".weight")
        if owner is not None and owner.linear:
            return ""
    return key


def _tensor_problems(name: str, info: TensorInfo, exp: Expected) -> list[Problem]:
    """A present tensor's shape against the config, and a float dtype for an unquantized vector."""
    problem = _shape_problem(name, info, exp)
    if problem is not None:
        return [problem]
    if not exp.linear and info.dtype not in _FLOAT_CODES:
        return [
            Problem(f"tensor {name}: expected dtype {', '.join(_FLOAT_CODES)}, got {info.dtype}", tensor=name)
        ]
    return []


def _missing(
    expected: Mapping[str, Expected], seen: set[str], cfg: ModelConfig, style: _Style
) -> list[Problem]:
    """The expected tensors the checkpoint lacks, in its own naming style."""
    missing = []
    for key, exp in expected.items():
        if key in seen:
            continue
        if exp.alternative is not None and _alternative_present(key, exp.alternative, seen):
            continue
        if exp.alternative == ("split" if not style.fused_conv else "fused"):
            continue  # neither form present: name the form this checkpoint's naming uses
        m = _LAYER.match(key)
        rendered = style.render(key, m is not None and cfg.is_moe_layer(int(m.group(1))))
        because = f" ({exp.because})" if exp.because else ""
        missing.append(Problem(f"tensor {rendered} is missing{because}"))
    return missing


def _alternative_present(key: str, alternative: str, seen: set[str]) -> bool:
    head = key.rpartition(".self_attn.")[0] + ".self_attn."
    if alternative == "split":  # key is the fused conv1d: satisfied by q/k/v_conv1d
        return any(f"{head}{c}_conv1d.weight" in seen for c in "qkv")
    return f"{head}conv1d.weight" in seen


def _unused(
    name: str, key: str, cfg: ModelConfig, f: _Fields, flipped: dict[int, list[tuple[str, str, set[str]]]]
) -> Problem:
    """Why the model has no place for tensor `name`: the config field that rules it out, where one does."""
    m = _LAYER.match(key)
    if m is not None:
        i = int(m.group(1))
        if i >= cfg.num_hidden_layers:
            return Problem(
                f"{f.setting('num_hidden_layers')} but the checkpoint has tensor {name} (layer {i})",
                group=f.name("num_hidden_layers"),
                tensor=name,
            )
        e = _EXPERT.match(key)
        if e is not None and cfg.is_moe_layer(i) and int(e.group(2)) >= int(cfg.num_experts or 0):
            return Problem(
                f"{f.setting('num_experts')} but the checkpoint has tensor {name} (expert {e.group(2)})",
                group=f.name("num_experts"),
                tensor=name,
            )
        rest = key[m.end() :]
        if i not in flipped:
            flipped[i] = _flipped_layer_kinds(cfg, f, i)
        for what, field, keys in flipped[i]:
            if f"layers.{i}.{rest}" in keys:
                return Problem(
                    f"config {f.name(field)} makes layer {i} (0-indexed) {what}, but tensor {name} belongs "
                    "to the other kind of layer",
                    group=f"{f.name(field)}:{i}",
                    tensor=name,
                )
    return Problem(f"tensor {name}: a model with this config has no such tensor (not used)", tensor=name)


def _flipped_layer_kinds(cfg: ModelConfig, f: _Fields, i: int) -> list[tuple[str, str, set[str]]]:
    """The tensors layer i would have as the other mixer / MLP kind."""
    import dataclasses

    out = []
    kda = list(cfg.layer_is_kda)
    kda[i] = not kda[i]
    other = dataclasses.replace(cfg, layer_is_kda=tuple(kda))
    what = "a KDA layer" if cfg.is_kda_layer(i) else "a full-attention (MLA) layer"
    try:
        out.append((what, "kda_layers", set(_mixer_tensors(other, f, i))))
    except (TypeError, ValueError):  # the other kind's sizes are not in this config
        pass
    moe = list(cfg.layer_is_moe)
    moe[i] = not moe[i]
    other = dataclasses.replace(cfg, layer_is_moe=tuple(moe))
    what = "a MoE layer" if cfg.is_moe_layer(i) else "a dense MLP layer"
    try:
        keys = set(_mlp_tensors(other, f, i))
    except (TypeError, ValueError):
        keys = set()
    keys |= {k.rpartition(".")[0] + "." + s for k in list(keys) for s in SCALE_SUFFIXES}
    out.append((what, "moe_layers", keys))
    return out


def _natural(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def header_problems(
    model_dir: str | Path,
    *,
    hf: Mapping[str, Any] | None = None,
    cfg: ModelConfig | None = None,
    tensors: Mapping[str, TensorInfo] | None = None,
) -> list[Problem]:
    """Stage 1: the config and every layer's scheme against the safetensors headers (no tensor data).

    Raises ValueError for a config.json that is invalid on its own (config.py names the field)."""
    from k3run.config import ModelConfig
    from k3run.quant.plan import build_quant_plan
    from k3run.safetensors_io import read_checkpoint_headers

    model_dir = Path(model_dir)
    if hf is None:
        hf = json.loads((model_dir / "config.json").read_text())
    if cfg is None:
        cfg = ModelConfig.from_hf(hf)
    if tensors is None:
        tensors = read_checkpoint_headers(model_dir)
    problems = config_problems(hf, cfg, tensors)
    layer_errors: list[tuple[str, str]] = []
    build_quant_plan(model_dir, tensors=dict(tensors), problems=layer_errors)
    # a layer whose tensors the config already rules out (an expert beyond num_experts) needs no second line
    reported = {p.tensor.rpartition(".")[0] for p in problems if p.tensor is not None}
    return problems + [Problem(m, tensor=prefix) for prefix, m in layer_errors if prefix not in reported]


def check_headers(model_dir: str | Path, **known: Any) -> None:
    """`header_problems`, raising CheckpointInvalid when there are any (what load_model runs first)."""
    problems = header_problems(model_dir, **known)
    if problems:
        raise CheckpointInvalid(model_dir, problems)


# ----------------------------------------------------------------------------------------------------------
# 2. scale values


def is_scale(name: str) -> bool:
    return name.rpartition(".")[2] in SCALE_SUFFIXES


def read_tensors(infos: Iterable[TensorInfo]) -> Iterator[tuple[TensorInfo, torch.Tensor]]:
    """The tensors `infos` in on-disk order, read with one positioned read per run of neighbours (at most
    _COALESCE_GAP apart, _READ_BATCH bytes per read); at most one batch is in memory at a time."""
    by_file: dict[Path, list[TensorInfo]] = defaultdict(list)
    for info in infos:
        by_file[info.file].append(info)
    for path, items in by_file.items():
        items.sort(key=lambda t: t.data_offsets)
        start = _data_start(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            batch: list[TensorInfo] = []
            for info in items:
                if batch and (
                    info.data_offsets[0] - batch[-1].data_offsets[1] > _COALESCE_GAP
                    or info.data_offsets[1] - batch[0].data_offsets[0] > _READ_BATCH
                ):
                    yield from _read_batch(fd, start, batch)
                    batch = []
                batch.append(info)
            if batch:
                yield from _read_batch(fd, start, batch)
        finally:
            os.close(fd)


def _read_batch(fd: int, start: int, batch: list[TensorInfo]) -> Iterator[tuple[TensorInfo, torch.Tensor]]:
    lo, hi = batch[0].data_offsets[0], max(t.data_offsets[1] for t in batch)
    buf = bytearray(hi - lo)
    view, done = memoryview(buf), 0
    while done < len(buf):
        n = os.preadv(fd, [view[done:]], start + lo + done)
        if n <= 0:
            raise OSError(f"{batch[0].file}: unexpected end of file at byte {start + lo + done}")
        done += n
    raw = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    for info in batch:
        a, b = info.data_offsets[0] - lo, info.data_offsets[1] - lo
        yield info, raw[a:b].clone().view(info.torch_dtype).reshape(info.shape)


_E4M3 = torch.float8_e4m3fn


def _bad_mask(name: str, t: torch.Tensor) -> tuple[torch.Tensor, str] | None:
    """(mask of invalid elements, the rule they break) for checkpoint tensor `name`; None if its dtype
    has no invalid values (integers, packed codes)."""
    scale = is_scale(name)
    if t.dtype == _E4M3:
        b = t.view(torch.uint8)
        if scale:
            rule = "NVFP4 E4M3 block scales must be finite and >= 0"
            return (b == 0x7F) | (b > 0x80), rule
        return (b & 0x7F) == 0x7F, "FP8 E4M3 weights must not be NaN"
    if t.dtype == torch.float8_e5m2:
        return (t.view(torch.uint8) & 0x7F) >= 0x7C, "FP8 E5M2 values must be finite"
    if t.dtype == torch.float8_e8m0fnu:
        return t.view(torch.uint8) == 0xFF, "E8M0 scales must not be NaN (0xFF)"
    if not t.is_floating_point():
        return None
    if scale:
        rule = "scales must be finite and > 0"
        if name.endswith(".weight_scale") and t.dim() == 4:
            rule = "FP8_PB_WO block scales must be finite and > 0 (ModelOpt: amax/448, 1.0 for a zero tile)"
        return ~(torch.isfinite(t) & (t > 0)), rule
    return ~torch.isfinite(t), "weights must be finite"


def _describe(t: torch.Tensor, idx: tuple[int, ...]) -> str:
    v = t[idx] if idx else t.reshape(())
    if t.dtype in (_E4M3, torch.float8_e5m2, torch.float8_e8m0fnu):
        byte = int(v.view(torch.uint8))
        return f"{float(v.float())} (byte 0x{byte:02x})"
    return repr(float(v))


def value_problem(name: str, t: torch.Tensor) -> Problem | None:
    """The invalid values of checkpoint tensor `name` (see the module docstring for the rules per
    format): the value and index of the first, and how many."""
    found = _bad_mask(name, t)
    if found is None:
        return None
    bad, rule = found
    if not bool(bad.any()):
        return None
    first = int(bad.reshape(-1).nonzero()[0, 0])
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), t.shape)) if t.dim() else ()
    where = f"at {list(idx)}" if idx else "(the scalar)"
    if idx and is_scale(name) and t.dtype == _E4M3 and t.dim() == 2:
        where += f" (row {idx[0]}, columns {idx[1] * 16}..{idx[1] * 16 + 15})"
    elif idx and is_scale(name) and t.dim() == 4:
        where = f"at block {list(idx)} (rows {idx[0] * 128}.., columns {idx[2] * 128}..)"
    n = int(bad.sum())
    count = f"; {n} of {t.numel()} values are invalid" if n > 1 else ""
    return Problem(f"tensor {name}: {_describe(t, idx)} {where}{count}; {rule}")


def scale_value_problems(
    tensors: Mapping[str, TensorInfo], *, block_scales: bool, stats: dict[str, int] | None = None
) -> list[Problem]:
    """Stage 2: every floating scale tensor among `tensors` read on the CPU and checked; the E4M3 / E8M0
    block scales only with `block_scales` (loading checks those on the device instead). Integer-typed
    scales (compressed-tensors stores E8M0 as U8) have no rule here and are not read. `stats["bytes"]`
    counts the bytes read."""
    chosen = [
        info
        for name, info in tensors.items()
        if is_scale(name)
        and (
            info.dtype in _FLOAT_CODES
            or info.dtype == "F64"
            or (block_scales and info.dtype in BLOCK_SCALE_CODES)
        )
    ]
    problems = []
    for info, t in read_tensors(chosen):
        if stats is not None:
            stats["bytes"] = stats.get("bytes", 0) + info.nbytes
        p = value_problem(info.name, t)
        if p is not None:
            problems.append(p)
    return sorted(problems, key=lambda p: _natural(p.message))


# ----------------------------------------------------------------------------------------------------------
# 3. parameters on the device


# What a parameter's reductions are compared with at the end: the reduction's dtype plus a test of it.
_FINITE, _NEGATIVE, _IS_127, _IS_255 = "finite", "negative", "is 0x7f", "is 0xff"


def _reductions(name: str, p: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The 0-dim reductions of parameter p (on its device) whose values decide whether it may hold an
    invalid value, each with the test that says so. One pass over p, nothing allocated; may flag a valid
    tensor (an E4M3 scale of -0), never misses an invalid one."""
    if p.numel() == 0:
        return []
    if p.dtype == _E4M3:
        i8 = p.view(torch.int8)
        if name.rpartition(".")[2].endswith("weight_scale"):
            lo, hi = torch.aminmax(i8)  # scales: any sign bit (negative, -0, 0xFF), or 0x7F
            return [(_NEGATIVE, lo), (_IS_127, hi)]
        return [(_IS_127, i8.max()), (_IS_255, p.view(torch.uint8).max())]  # the two NaN bytes
    if p.dtype == torch.float8_e8m0fnu:
        return [(_IS_255, p.view(torch.uint8).max())]
    if p.dtype == torch.float8_e5m2:  # not in Kimi checkpoints: a mask is fine
        return [(_IS_255, ((p.view(torch.uint8) & 0x7F) >= 0x7C).any().to(torch.uint8) * 255)]
    if not p.is_floating_point():
        return []
    lo, hi = torch.aminmax(p)  # NaN anywhere makes both NaN, an infinity shows in one of them
    return [(_FINITE, lo), (_FINITE, hi)]


def _failing(test: str, values: torch.Tensor) -> torch.Tensor:
    if test == _FINITE:
        return ~torch.isfinite(values)
    if test == _NEGATIVE:
        return values < 0
    return values == (0x7F if test == _IS_127 else 0xFF)


def screen_parameters(params: Mapping[str, torch.Tensor]) -> list[str]:
    """Stage 3: the names of the parameters that may hold NaN / Inf (or invalid E4M3 scales). Each
    parameter costs one reduction launch (two for FP8 weights); the results are compared in a few launches
    per device and read back with ONE host sync per device."""
    names = [n for n, p in params.items() if p.device.type != "meta"]
    pending: dict[tuple[torch.device, str, torch.dtype], list[tuple[int, torch.Tensor]]] = defaultdict(list)
    with torch.no_grad():
        for k, name in enumerate(names):
            p = params[name].detach()
            for test, value in _reductions(name, p):
                pending[(p.device, test, value.dtype)].append((k, value))
    by_device: dict[torch.device, tuple[list[int], list[torch.Tensor]]] = defaultdict(lambda: ([], []))
    for (device, test, _), items in pending.items():
        owners, bad = by_device[device]
        owners += [k for k, _ in items]
        bad.append(_failing(test, torch.stack([v for _, v in items])))
    flagged: set[int] = set()
    for owners, bad in by_device.values():
        hits = torch.cat(bad).nonzero().reshape(-1).tolist()  # the one sync (per device)
        flagged.update(owners[i] for i in hits)
    return [names[k] for k in sorted(flagged)]


def confirm_from_checkpoint(
    flagged: Sequence[str], feeds: Mapping[str, Sequence[TensorInfo]]
) -> list[Problem]:
    """The checkpoint tensors behind flagged parameters, read back and checked exactly (the error path).
    A parameter whose tensors are all valid was a false alarm (padding rows never written, an E4M3 -0)."""
    wanted = {info.name: info for name in flagged for info in feeds.get(name, ())}
    problems = []
    for info, t in read_tensors(wanted.values()):
        p = value_problem(info.name, t)
        if p is not None:
            problems.append(p)
    return sorted(problems, key=lambda p: _natural(p.message))


# ----------------------------------------------------------------------------------------------------------
# everything, for `k3run inspect`


def validate_checkpoint(
    model_dir: str | Path, *, values: bool = True, stats: dict[str, int] | None = None
) -> list[Problem]:
    """What `k3run inspect` checks: stage 1, stage 2 with the block scales (`values`), and, when the
    headers are consistent, the loader itself run on a model on the meta device with no data read (its
    name mapping, per-parameter shape and dtype checks and completeness), so nothing load_model would
    refuse for names, shapes or dtypes passes here. Weight values (stage 3) need the weights: loading only."""
    from k3run.config import ModelConfig
    from k3run.safetensors_io import read_checkpoint_headers

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (expected a Hugging Face checkpoint directory)")
    hf = json.loads((model_dir / "config.json").read_text())
    cfg = ModelConfig.from_hf(hf)
    tensors = read_checkpoint_headers(model_dir)
    problems = header_problems(model_dir, hf=hf, cfg=cfg, tensors=tensors)
    if not problems:  # otherwise the loader would repeat them in its own terms, or the model not build
        problems += _dry_run(model_dir, cfg, tensors)
    if values:
        problems += scale_value_problems(tensors, block_scales=True, stats=stats)
    return problems


def _dry_run(
    model_dir: Path, cfg: ModelConfig, tensors: dict[str, TensorInfo] | None = None
) -> list[Problem]:
    from k3run.loader import load_checkpoint
    from k3run.models.kimi import KimiForCausalLM
    from k3run.quant.modelopt import load_quant_config

    try:
        with torch.device("meta"):
            model = KimiForCausalLM(cfg, qcfg=load_quant_config(model_dir, tensors=tensors))
        load_checkpoint(
            model, model_dir, model.checkpoint_mapping, progress=False, dry_run=True, infos=tensors
        )
    except CheckpointInvalid as e:
        return e.problems
    except ValueError as e:  # the model cannot be built, or the loader refused (LoadError)
        return [Problem(" ".join(str(e).split()))]
    return []
