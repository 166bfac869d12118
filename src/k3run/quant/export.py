"""`k3run quantize`: write a ModelOpt-format checkpoint from a bf16 Hugging Face checkpoint.

Recipes (which linear layers get which scheme; every other tensor is copied unchanged):
- "nvfp4": every linear NVFP4, except lm_head, embeddings, MoE routers and AttnRes `*_res_proj` vectors.
- "fp8_pb_wo": the same layers as 128x128-block FP8, weight only.
- "k3-mixed": what nvidia/Kimi-K3-NVFP4 uses: routed experts NVFP4; the attention projections (KDA q/k/v/g/
  b/f_a/f_b and g_a/g_b, MLA q/q_a/q_b/kv_a_proj_with_mqa/kv_b/g, o_proj) FP8_PB_WO; everything else bf16.

Tensors are what ModelOpt 0.47 exports (run on a CPU; checked byte for byte against the real exports in
tests/fixtures, tests/fixtures/README.md): k3run.formats quantizes, and linears that read the same input share
their global scale as ModelOpt's fusion pass makes them (NVFP4 `weight_scale_2`; FP8_PB_WO only when every
member is a single 128x128 tile, the one case ModelOpt unifies). hf_quant_config.json (legacy form) and
config.json `quantization_config` (flat form) follow ModelOpt's writer, MIXED_PRECISION as the K3 converter
writes it (quantized_layers under several spellings, quant_method "modelopt_mixed").

Differences from ModelOpt, on purpose:
- No calibration: NVFP4 `input_scale` is 1.0 (activation amax 2688), as the K3 converter writes it. On
  Hopper k3run runs NVFP4 weight-only, where input_scale is not used.
- A layer the scheme cannot hold in k3run (NVFP4 needs K % 16 == 0, FP8_PB_WO K % 128 == 0) stays bf16 and
  is listed in the excludes, with a warning, instead of being written in a form k3run and vLLM refuse
  (`partial_k_tiles=True` writes FP8_PB_WO edge tiles along K as ModelOpt does). A routed-expert bank is
  quantized whole or not at all (one fused MoE layer per bank in k3run and vLLM); a bank kept whole is
  listed in the excludes by its own name as well as by its projections'.
- Module names are kept as in the source checkpoint (ModelOpt under transformers 5 renames Kimi's).
- producer is {"name": "modelopt", "version": "0.47.0+k3run.<version>"}: the name loaders require, and a
  version saying which writer's format this is and that k3run wrote it.

Streaming: tensors are read one fusion group at a time and written to output shards of at most
`max_shard_bytes`, so peak memory is one group plus one output shard, not the model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from k3run import __version__
from k3run.formats import FP8_E4M3_MAX, nvfp4_global_scale, quantize_fp8_block, quantize_nvfp4
from k3run.quant.algo import QuantAlgo
from k3run.safetensors_io import INDEX_FILE, CheckpointReader, TensorInfo

RECIPES = ("nvfp4", "fp8_pb_wo", "k3-mixed")
PRODUCER: Mapping[str, str] = MappingProxyType({"name": "modelopt", "version": f"0.47.0+k3run.{__version__}"})
NVFP4_GROUP = 16
FP8_BLOCK = 128
DEFAULT_MAX_SHARD_BYTES = 4 * 2**30

_EMBEDDINGS = frozenset({"embed_tokens", "word_embeddings", "wte"})
_VISION = ("vision_tower", "vision_model", "mm_projector", "multi_modal_projector")
_ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)$")
_EXPERT_BANK = re.compile(r"^(?P<bank>.+\.experts)\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)$")
_ATTN_PROJ = frozenset(
    {
        "q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj",
        "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
    }
)  # fmt: skip
# Linears of one attention / MLP module that read the same activation (ModelOpt's fusion groups).
_ATTN_INPUT = frozenset({"q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "f_a_proj", "g_a_proj"})
_ATTN_INPUT |= {"q_a_proj", "kv_a_proj_with_mqa"}
_MLP_INPUT = frozenset({"gate_proj", "up_proj", "w1", "w3"})
_FLOAT = (torch.bfloat16, torch.float16, torch.float32)

_NVFP4_ACT: Mapping[str, Any] = MappingProxyType(
    {"dynamic": False, "num_bits": 4, "type": "float", "group_size": NVFP4_GROUP}
)


def _last(prefix: str) -> str:
    return prefix.rpartition(".")[2]


def _never_quantized(prefix: str) -> bool:
    """Modules every recipe keeps in high precision."""
    last = _last(prefix)
    return (
        last in ("lm_head", "gate")  # output head; MoE router (its fp32 logits decide the routing)
        or last in _EMBEDDINGS
        or last.endswith("_res_proj")  # AttnRes pseudo-query vectors [1, D], not used as a matmul
        or any(v in prefix for v in _VISION)
    )


def _is_attention(prefix: str) -> bool:
    return ".self_attn." in prefix or ".attn." in prefix


def recipe_algo(recipe: str, prefix: str) -> QuantAlgo:
    """The scheme `recipe` gives the linear layer at `prefix` (before the K divisibility fallback)."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe {recipe!r}: expected one of {', '.join(RECIPES)}")
    if _never_quantized(prefix):
        return QuantAlgo.NONE
    if recipe == "nvfp4":
        return QuantAlgo.NVFP4
    if recipe == "fp8_pb_wo":
        return QuantAlgo.FP8_PB_WO
    if _ROUTED_EXPERT.search(prefix):
        return QuantAlgo.NVFP4
    if _is_attention(prefix) and _last(prefix) in _ATTN_PROJ:
        return QuantAlgo.FP8_PB_WO
    return QuantAlgo.NONE


def fusion_key(prefix: str) -> str:
    """Linears with the same key read the same input, so ModelOpt gives them one global scale.

    Checked against ModelOpt's exports of Llama and Kimi Linear (tests/fixtures). K3's latent MoE
    projection and shared experts also read the block input, but whether ModelOpt's input hook sees one
    tensor there is not verified, so they keep their own scales (k3-mixed leaves them bf16 anyway).
    """
    parent, _, last = prefix.rpartition(".")
    if last in _MLP_INPUT:
        return f"{parent}.<mlp-in>"
    if last in _ATTN_INPUT and _is_attention(prefix):
        # transformers 5 nests Kimi's forget-gate projections one level down; they still read x
        return f"{parent.removesuffix('.forget_gate')}.<attn-in>"
    return prefix


@dataclass
class _Layer:
    prefix: str
    info: TensorInfo  # the .weight
    algo: QuantAlgo


@dataclass
class _ShardWriter:
    """Collects output tensors and writes a shard whenever `max_bytes` is reached."""

    dst: Path
    max_bytes: int
    pending: dict[str, torch.Tensor] = field(default_factory=dict)
    pending_bytes: int = 0
    files: list[tuple[Path, list[str]]] = field(default_factory=list)
    total_bytes: int = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self.flush()
        self.pending[name] = t.detach().cpu().contiguous()  # a source may produce device tensors
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        path = self.dst / f".k3run-shard-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        self.flush()
        if len(self.files) == 1:
            self.files[0][0].rename(self.dst / "model.safetensors")
            return
        n = len(self.files)
        weight_map: dict[str, str] = {}
        for i, (path, names) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            path.rename(self.dst / final)
            weight_map |= dict.fromkeys(names, final)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.dst / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _read_config(src: Path) -> dict[str, Any]:
    path = src / "config.json"
    if not path.is_file():
        raise ValueError(f"{path}: missing; a Hugging Face checkpoint directory needs config.json")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    for where, qc in (
        ("quantization_config", config.get("quantization_config")),
        ("text_config.quantization_config", (config.get("text_config") or {}).get("quantization_config")),
    ):
        if qc is not None:
            method = qc.get("quant_method") if isinstance(qc, dict) else qc
            raise ValueError(
                f"{path}: {where} is present (quant_method {method!r}); k3run quantize needs an unquantized "
                "bf16/fp16/fp32 checkpoint"
            )
    if (src / "hf_quant_config.json").exists():
        raise ValueError(f"{src / 'hf_quant_config.json'}: present; the source is already quantized")
    return config


def _plan_layers(
    recipe: str, tensors: dict[str, TensorInfo], partial_k_tiles: bool
) -> tuple[list[_Layer], list[str]]:
    """Every 2-D float `.weight` module with its scheme; also the warnings for layers kept in bf16."""
    layers: list[_Layer] = []
    notes: list[str] = []
    for name, info in tensors.items():
        if not name.endswith(".weight") or len(info.shape) != 2:
            continue
        prefix = name[: -len(".weight")]
        if info.torch_dtype not in _FLOAT:
            raise ValueError(
                f"tensor {name}: expected an unquantized bf16/fp16/fp32 weight, got {info.dtype}; "
                "k3run quantize needs an unquantized source"
            )
        algo = recipe_algo(recipe, prefix)
        k = info.shape[1]
        if algo in (QuantAlgo.NVFP4, QuantAlgo.W4A16_NVFP4) and k % NVFP4_GROUP:
            notes.append(f"{prefix}: K={k} is not a multiple of {NVFP4_GROUP}; kept in {info.dtype}")
            algo = QuantAlgo.NONE
        elif algo is QuantAlgo.FP8_PB_WO and k % FP8_BLOCK and not partial_k_tiles:
            notes.append(f"{prefix}: K={k} is not a multiple of {FP8_BLOCK}; kept in {info.dtype}")
            algo = QuantAlgo.NONE
        layers.append(_Layer(prefix, info, algo))
    # a routed-expert bank runs under one scheme (k3run and vLLM build one fused MoE layer per bank): if
    # any projection of a bank cannot be held (e.g. FP8_PB_WO w2 with K = intermediate % 128 != 0), the
    # whole bank stays in the source dtype
    banks: dict[str, list[_Layer]] = {}
    for lay in layers:
        m = _EXPERT_BANK.match(lay.prefix)
        if m is not None:
            banks.setdefault(m["bank"], []).append(lay)
    for bank, members in banks.items():
        kept = [m.prefix for m in members if m.algo is QuantAlgo.NONE]
        if kept and len(kept) < len(members):
            notes.append(
                f"{bank}: {len(kept)} of its {len(members)} routed-expert projections stay unquantized "
                f"(e.g. {kept[0]}); a bank runs under one scheme, so all of them are kept"
            )
            for lay in members:
                lay.algo = QuantAlgo.NONE
    return layers, notes


def _kept_banks(layers: list[_Layer]) -> list[str]:
    """Routed-expert banks whose every projection stays unquantized: the exclude list names the bank itself
    too, as a reader that resolves one scheme per bank (vLLM's fused MoE, k3run) looks it up."""
    algos: dict[str, set[QuantAlgo]] = {}
    for lay in layers:
        m = _EXPERT_BANK.match(lay.prefix)
        if m is not None:
            algos.setdefault(m["bank"], set()).add(lay.algo)
    return [bank for bank, a in algos.items() if a == {QuantAlgo.NONE}]


def _single_tile(info: TensorInfo) -> bool:
    return info.shape[0] <= FP8_BLOCK and info.shape[1] <= FP8_BLOCK


def _quantize_group(members: list[_Layer], load: Callable[[str], torch.Tensor], out: _ShardWriter) -> None:
    """Quantize the layers of one fusion group (all with the same scheme) and hand their tensors to `out`."""
    algo = members[0].algo
    weights = {m.prefix: load(f"{m.prefix}.weight") for m in members}
    amax = max(float(w.abs().amax().float()) for w in weights.values())
    if algo is QuantAlgo.NVFP4:
        shared = nvfp4_global_scale(amax) if len(members) > 1 else None
        for m in members:
            q = quantize_nvfp4(weights[m.prefix], weight_scale_2=shared)
            out.add(f"{m.prefix}.weight", q.weight)
            out.add(f"{m.prefix}.weight_scale", q.weight_scale)
            out.add(f"{m.prefix}.weight_scale_2", q.weight_scale_2.reshape(()))
            out.add(f"{m.prefix}.input_scale", torch.tensor(1.0, dtype=torch.float32))
        return
    assert algo is QuantAlgo.FP8_PB_WO
    share = len(members) > 1 and all(_single_tile(m.info) for m in members)
    for m in members:
        w = weights[m.prefix]
        if share:
            # one 128x128 tile each: ModelOpt sees a per-tensor amax and unifies it over the group
            scale = torch.tensor(amax if amax > 0 else FP8_E4M3_MAX, dtype=torch.float32) / FP8_E4M3_MAX
            codes = (w.float() / scale).to(torch.float8_e4m3fn)
        else:
            codes, scale = quantize_fp8_block(w)
        out.add(f"{m.prefix}.weight", codes)
        # ModelOpt writes a single-tile scale as a 0-dim tensor
        out.add(f"{m.prefix}.weight_scale", scale.reshape(()) if scale.numel() == 1 else scale)


def _spellings(prefix: str) -> list[str]:
    """The names the K3 converter lists a quantized layer under in quantized_layers."""
    names = [prefix]
    if prefix.startswith("language_model.model."):
        rest = prefix[len("language_model.model.") :]
        names += [f"model.{rest}", rest]
    elif prefix.startswith("model."):
        names.append(prefix[len("model.") :])
    names += [n.replace(".block_sparse_moe.", ".mlp.") for n in names if ".block_sparse_moe." in n]
    return names


def _fused_names(quantized: Mapping[str, QuantAlgo]) -> dict[str, QuantAlgo]:
    """vLLM's fused K3 attention names, listed explicitly when every shard has one scheme."""
    out: dict[str, QuantAlgo] = {}
    fused = {
        "in_proj_qkvgfab": ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj"),
        "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
    }
    parents = {p.rpartition(".")[0] for p in quantized if _is_attention(p)}
    for parent in sorted(parents):
        for fused_name, shards in fused.items():
            algos = {quantized.get(f"{parent}.{s}") for s in shards}
            algo = algos.pop() if len(algos) == 1 else None
            if algo is not None:
                out[f"{parent}.{fused_name}"] = algo
    return out


def _layer_entry(algo: QuantAlgo) -> dict[str, Any]:
    if algo is QuantAlgo.NVFP4:
        return {"quant_algo": "NVFP4", "group_size": NVFP4_GROUP}
    return {"quant_algo": algo.value}


def _group_config(entry: dict[str, Any]) -> dict[str, Any]:
    if entry["quant_algo"] == "NVFP4":
        return {"input_activations": dict(_NVFP4_ACT), "weights": dict(_NVFP4_ACT)}
    # ModelOpt has no compressed-tensors form for FP8_PB_WO and writes the bare algorithm
    return {"quant_algo": entry["quant_algo"]}


def quant_configs(
    recipe: str, quantized: Mapping[str, QuantAlgo], excludes: list[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(hf_quant_config.json, config.json quantization_config) as ModelOpt writes them for this export."""
    producer = dict(PRODUCER)
    excludes = sorted(excludes)
    hf: dict[str, Any]
    if recipe == "nvfp4":
        hf = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": NVFP4_GROUP}
        hf["exclude_modules"] = excludes
        group = {"input_activations": dict(_NVFP4_ACT), "weights": dict(_NVFP4_ACT), "targets": ["Linear"]}
        qc: dict[str, Any] = {"config_groups": {"group_0": group}, "ignore": excludes, "quant_algo": "NVFP4"}
        qc |= {"producer": producer, "quant_method": "modelopt"}
        return {"producer": producer, "quantization": hf}, qc
    if recipe == "fp8_pb_wo":
        # ModelOpt's constant for this format is lower case
        hf = {"quant_algo": "fp8_pb_wo", "kv_cache_quant_algo": None, "exclude_modules": excludes}
        qc = {"ignore": excludes, "quant_algo": "fp8_pb_wo", "producer": producer, "quant_method": "modelopt"}
        return {"producer": producer, "quantization": hf}, qc
    layers: dict[str, dict[str, Any]] = {}
    for prefix, algo in quantized.items():
        for name in _spellings(prefix):
            layers[name] = _layer_entry(algo)
    for prefix, algo in _fused_names(quantized).items():
        for name in _spellings(prefix):
            layers[name] = _layer_entry(algo)
    if not layers:
        raise ValueError("k3-mixed: the source has no routed experts or attention projections to quantize")
    hf = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "group_size": NVFP4_GROUP}
    hf |= {"quantized_layers": layers, "exclude_modules": excludes}
    by_entry: dict[tuple, list[str]] = {}
    for name, entry in layers.items():
        by_entry.setdefault(tuple(sorted(entry.items())), []).append(name)
    groups: dict[str, dict[str, Any]] = {}
    for i, (key, names) in enumerate(by_entry.items()):
        groups[f"group_{i}"] = _group_config(dict(key)) | {"targets": sorted(names)}
    qc = {"config_groups": groups, "quantized_layers": layers, "ignore": excludes}
    qc |= {"quant_algo": "MIXED_PRECISION", "producer": producer, "quant_method": "modelopt_mixed"}
    return {"producer": producer, "quantization": hf}, qc


def quantize_tensors(
    tensors: dict[str, TensorInfo],
    get: Callable[[str], torch.Tensor],
    config: dict[str, Any],
    dst: Path,
    recipe: str,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    partial_k_tiles: bool = False,
    progress: bool = True,
) -> None:
    """`quantize_checkpoint` from any tensor source: `tensors` (name -> the header's TensorInfo) and `get`
    (name -> the tensor, read when its group is quantized, so a source larger than memory streams). Writes
    the shards, hf_quant_config.json and config.json (`config` plus its quantization_config) to dst."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe {recipe!r}: expected one of {', '.join(RECIPES)}")
    layers, notes = _plan_layers(recipe, tensors, partial_k_tiles)
    for note in notes:
        warnings.warn(f"k3run quantize ({recipe}): {note}", stacklevel=2)
    by_prefix = {lay.prefix: lay for lay in layers}
    groups: dict[tuple[str, QuantAlgo], list[_Layer]] = {}
    for lay in layers:
        if lay.algo is not QuantAlgo.NONE:
            groups.setdefault((fusion_key(lay.prefix), lay.algo), []).append(lay)
    quantized_names = {f"{lay.prefix}.weight" for lay in layers if lay.algo is not QuantAlgo.NONE}
    passthrough = [n for n in tensors if n not in quantized_names]

    dst.mkdir(parents=True, exist_ok=True)
    out = _ShardWriter(dst, max_shard_bytes)
    units = len(groups) + len(passthrough)
    with tqdm(total=units, desc=f"quantize {recipe}", unit="group", disable=not progress) as bar:
        for members in groups.values():
            _quantize_group(members, get, out)
            bar.update(1)
        for name in passthrough:
            out.add(name, get(name))
            bar.update(1)
    out.finish()

    quantized = {lay.prefix: lay.algo for lay in layers if lay.algo is not QuantAlgo.NONE}
    excludes = [p for p, lay in by_prefix.items() if lay.algo is QuantAlgo.NONE] + _kept_banks(layers)
    hf_quant, qc = quant_configs(recipe, quantized, excludes)
    (dst / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=4) + "\n")
    (dst / "config.json").write_text(json.dumps(config | {"quantization_config": qc}, indent=2) + "\n")


def quantize_checkpoint(
    src_dir: str | Path,
    dst_dir: str | Path,
    recipe: str,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    partial_k_tiles: bool = False,
    progress: bool = True,
) -> None:
    """Quantize the bf16 checkpoint in `src_dir` with `recipe` and write a ModelOpt checkpoint to `dst_dir`
    (created; must not exist or be empty). Other files (tokenizer, generation config, code) are copied.

    partial_k_tiles: also write FP8_PB_WO layers whose K is not a multiple of 128, with zero-padded edge
    tiles, exactly as ModelOpt does. vLLM and k3run refuse to load those layers, so by default they stay bf16.
    """
    src, dst = Path(src_dir), Path(dst_dir)
    if recipe not in RECIPES:
        raise ValueError(f"recipe {recipe!r}: expected one of {', '.join(RECIPES)}")
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"{dst}: exists and is not empty")
    config = _read_config(src)
    with CheckpointReader(src) as reader:
        quantize_tensors(
            reader.tensors, reader.get, config, dst, recipe, max_shard_bytes=max_shard_bytes,
            partial_k_tiles=partial_k_tiles, progress=progress,
        )  # fmt: skip
    for f in sorted(src.iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", INDEX_FILE):
            shutil.copy2(f, dst / f.name)
            os.chmod(dst / f.name, 0o644)
