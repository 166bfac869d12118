"""QuantPlan: what every linear-like layer of a checkpoint is, before any tensor data is read.

Built from config.json (the ModelOpt config, quant/modelopt.py) and the safetensors headers only, so
`k3run inspect` describes a multi-terabyte checkpoint in seconds. For each module prefix that owns a 2-D
`.weight` it records the scheme, the logical weight shape [N, K], the shape the scheme holds after padding,
the bytes of its tensors and the kernel that will run it. Building the plan also checks that the config and
the tensors agree (dtype, presence and shape of every scale); a checkpoint that fails here would otherwise
load quantized bytes into the wrong parameters and produce garbage without an error.
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from k3run.quant.algo import QuantAlgo
from k3run.quant.compressed_tensors import CompressedTensorsConfig
from k3run.quant.modelopt import ModelOptConfig, QuantConfig, expert_bank, load_quant_config
from k3run.safetensors_io import TensorInfo, read_checkpoint_headers

FP8_BLOCK = 128
NVFP4_GROUP = 16
# Tensors that belong to a linear layer; anything else (norms, convs, A_log, router bias) is "other".
LAYER_SUFFIXES = ("weight", "weight_packed", "bias", "weight_scale", "weight_scale_2", "input_scale")
MXFP4_GROUP = 32
_EMBEDDING_NAMES = frozenset({"embed_tokens", "word_embeddings", "wte"})
_FLOAT_CODES = ("BF16", "F16", "F32")

# CPU: kernels/cpu_simd.py where the CPU has AVX-512 or AVX2, else kernels/cpu_fused.py's compiled loops
_CPU_QUANT = "AVX-512 / AVX2 extension or compiled loop if >= 1M weights, else dequantize + matmul"
_NVFP4_CUDA = "kernels/nvfp4_gemm: Gluon W4A16 decode kernel (M <= 32), dequantize + cuBLAS above"
_EXPERTS_CPU = "layers/moe fused_experts: per-expert loop (the CPU linear paths)"
_EXPERTS_CUDA = (
    "layers/moe fused_experts: NVFP4 on sm_89+: two grouped decode launches (expert-major for 2..128 tokens, "
    "no host sync); otherwise (prefill sizes, other schemes) a per-expert loop"
)
_MXFP4_EXPERTS = "MXFP4 (compressed-tensors) -> NVFP4 transcode at load (lossless), then "
# The kernel each (layer kind, device type, scheme) runs; the one place `k3run inspect` reads it from.
_IMPLEMENTATIONS: Mapping[tuple[str, str, QuantAlgo], str] = MappingProxyType(
    {
        ("linear", "cpu", QuantAlgo.NONE): "torch F.linear",
        ("linear", "cpu", QuantAlgo.FP8_PB_WO): _CPU_QUANT,
        ("linear", "cpu", QuantAlgo.NVFP4): _CPU_QUANT,
        ("linear", "cpu", QuantAlgo.W4A16_NVFP4): _CPU_QUANT,
        ("linear", "cuda", QuantAlgo.NONE): "torch F.linear (cuBLAS)",
        ("linear", "cuda", QuantAlgo.FP8_PB_WO): "kernels/fp8_gemm: 1x128 fp8 activations x 128x128 blocks "
        "(block-scaled _scaled_mm on sm90, else Triton; calls of <= 16 rows: one Triton GEMV with the "
        "quantization fused)",
        ("linear", "cuda", QuantAlgo.NVFP4): _NVFP4_CUDA,
        ("linear", "cuda", QuantAlgo.W4A16_NVFP4): _NVFP4_CUDA,
        **{("expert", "cpu", a): _EXPERTS_CPU for a in QuantAlgo if a is not QuantAlgo.FP8},
        **{("expert", "cuda", a): _EXPERTS_CUDA for a in QuantAlgo if a is not QuantAlgo.FP8},
        ("expert", "cpu", QuantAlgo.MXFP4): _MXFP4_EXPERTS + _EXPERTS_CPU,
        ("expert", "cuda", QuantAlgo.MXFP4): _MXFP4_EXPERTS + _EXPERTS_CUDA,
    }
)


def implementation_name(algo: QuantAlgo, device: str | torch.device = "cpu", kind: str = "linear") -> str:
    """The kernel that runs a layer of scheme `algo` on `device` ("cpu", "cuda", "cuda:1", ...).

    kind: "linear", or "expert" for a routed expert (run by the MoE layer, not as a separate linear).
    """
    dev = torch.device(device).type
    name = _IMPLEMENTATIONS.get((kind, dev, algo))
    if name is not None:
        return name
    if algo is QuantAlgo.FP8:
        return "unsupported: k3run has no per-tensor FP8 scheme"
    return f"unsupported: no {algo.value} {kind} kernel for device type {dev!r}"


def nvfp4_fp8_implementation(n: int, k: int) -> str | None:
    """What an NVFP4 linear [N, K] runs on an sm90 GPU with load_model(nvfp4_as_fp8=True), from the rule in
    quant/schemes.py (`nvfp4_fp8_faster`); None where that rule never picks the FP8 copy."""
    from k3run.kernels.fp8_gemm import scaled_mm_shape_ok
    from k3run.quant.schemes import FP8_BLOCK as BLOCK
    from k3run.quant.schemes import NVFP4_DECODE_MAX_M, nvfp4_fp8_faster

    if k % BLOCK:
        return None
    backend = "scaled_mm" if scaled_mm_shape_ok(k) else "triton"
    small = nvfp4_fp8_faster(1, n, k, backend)
    large = nvfp4_fp8_faster(NVFP4_DECODE_MAX_M + 1, n, k, backend)
    if not (small or large):
        return None
    if small and large:
        when = "every M"
    else:
        when = f"M > {NVFP4_DECODE_MAX_M}" if large else f"M <= {NVFP4_DECODE_MAX_M}"
        when += ", the NVFP4 kernels otherwise"
    return f"NVFP4 -> FP8 128x128 blocks at load (opt-in, lossy): kernels/fp8_gemm _scaled_mm for {when}"


@dataclass(frozen=True)
class LayerPlan:
    prefix: str
    kind: str  # "linear", "expert" (a routed expert, run by the MoE layer) or "embedding"
    algo: QuantAlgo
    logical_shape: tuple[int, int]  # [N, K]
    physical_shape: tuple[int, int]  # after the scheme's padding
    nbytes: int  # all tensors of the layer as stored
    implementation: str
    tensors: tuple[str, ...]

    @property
    def padding(self) -> tuple[int, int]:
        """(rows, columns) the scheme adds to the logical weight."""
        return (
            self.physical_shape[0] - self.logical_shape[0],
            self.physical_shape[1] - self.logical_shape[1],
        )


@dataclass(frozen=True)
class QuantPlan:
    model_dir: Path
    device: str
    quant_config: ModelOptConfig | CompressedTensorsConfig | None
    layers: tuple[LayerPlan, ...]
    other_tensors: int
    other_bytes: int
    # Kimi checkpoints: the float tensors held in a dtype other than the model's, or rounded at load
    # (models/kimi.py `held_dtypes`), as "pattern (stored dtype [shape] xN) -> held dtype"
    model_dtype: str | None = None
    held_dtype_notes: tuple[str, ...] = ()
    # what resolving the config took from the tensors (compressed-tensors "Linear" targets stored as bf16)
    config_notes: tuple[str, ...] = ()

    def layer(self, prefix: str) -> LayerPlan:
        for lp in self.layers:
            if lp.prefix == prefix:
                return lp
        raise KeyError(f"{self.model_dir}: no linear-like layer {prefix!r}")

    def bytes_by_scheme(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for lp in self.layers:
            out[lp.algo.value if lp.kind != "embedding" else lp.kind] += lp.nbytes
        if self.other_bytes:
            out["other"] += self.other_bytes
        return dict(out)

    def format_table(self) -> str:
        """The text `k3run inspect DIR` prints: one row per layer (routed experts folded into one row per
        layer and projection when they are identical), then parameter bytes by scheme."""
        qc = self.quant_config
        head = "unquantized (no quantization config)" if qc is None else qc.summary()
        lines = [f"{self.model_dir}: {head}; device {self.device}", ""]
        lines += self._layer_rows()
        lines += ["", "parameter bytes by scheme:", *self._scheme_rows()]
        if self.config_notes:
            lines += ["", "quantization config:", *(f"  {note}" for note in self.config_notes)]
        if self.held_dtype_notes:
            lines += ["", f"tensors held in another dtype than the model's {self.model_dtype}:"]
            lines += [f"  {note}" for note in self.held_dtype_notes]
        return "\n".join(lines)

    def _layer_rows(self) -> list[str]:
        """The layer table, columns padded to their widest cell."""
        rows = [("layer", "scheme", "logical [N, K]", "physical", "padding", "bytes", "implementation")]
        for label, lp, count in _folded(self.layers):
            pad = lp.padding
            rows.append(
                (
                    label,
                    lp.algo.value if lp.kind != "embedding" else f"{lp.algo.value} (embedding)",
                    _shape(lp.logical_shape),
                    _shape(lp.physical_shape),
                    f"N+{pad[0]}" if pad[0] else ("K+" + str(pad[1]) if pad[1] else "-"),
                    _human(lp.nbytes * count),
                    lp.implementation,
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]

    def _scheme_rows(self) -> list[str]:
        """Parameter bytes by scheme, largest first, with each one's share, layer count and weights."""
        by_scheme = self.bytes_by_scheme()
        total = sum(by_scheme.values())
        counts: dict[str, int] = defaultdict(int)
        params: dict[str, int] = defaultdict(int)
        for lp in self.layers:
            key = lp.algo.value if lp.kind != "embedding" else lp.kind
            counts[key] += 1
            params[key] += lp.logical_shape[0] * lp.logical_shape[1]
        out = []
        for key, nbytes in sorted(by_scheme.items(), key=lambda kv: -kv[1]):
            n = self.other_tensors if key == "other" else counts[key]
            what = f"{n} {'tensor' if key == 'other' else 'layer'}{'' if n == 1 else 's'}"
            extra = "" if key == "other" else f", {params[key] / 1e6:.2f}M weights"
            share = 100.0 * nbytes / total if total else 0.0
            out.append(f"  {key:<12} {_human(nbytes):>11}  {share:5.1f}%  ({what}{extra})")
        out.append(f"  {'total':<12} {_human(total):>11}")
        return out


def _shape(s: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in s) + "]"


def _human(n: int) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)(\..+)$")


def _folded(layers: tuple[LayerPlan, ...]) -> list[tuple[str, LayerPlan, int]]:
    """Table rows: identical routed-expert layers of one MoE block and projection become one row, placed
    where its first expert would be."""
    groups: dict[tuple, list[int]] = {}
    order: list[LayerPlan | tuple] = []
    for lp in layers:
        m = _EXPERT.match(lp.prefix)
        if m is None:
            order.append(lp)
            continue
        key = (
            m.group(1),
            m.group(3),
            lp.algo,
            lp.logical_shape,
            lp.physical_shape,
            lp.nbytes,
            lp.implementation,
        )
        if key not in groups:
            groups[key] = []
            order.append((key, lp))
        groups[key].append(int(m.group(2)))
    rows: list[tuple[str, LayerPlan, int]] = []
    for item in order:
        if isinstance(item, LayerPlan):
            rows.append((item.prefix, item, 1))
            continue
        key, first = item
        ids = groups[key]
        if len(ids) == 1:
            rows.append((first.prefix, first, 1))
            continue
        lo, hi = min(ids), max(ids)
        span = f"{lo}..{hi}" if hi - lo + 1 == len(ids) else f"{len(ids)} of {lo}..{hi}"
        rows.append((f"{key[0]}[{span}]{key[1]} x{len(ids)}", first, len(ids)))
    return rows


def _model_order(name: str) -> tuple:
    """Embeddings, then the layers in numeric order, then the rest (lm_head): the order of the forward."""
    rank = 0 if name.rpartition(".")[2] in _EMBEDDING_NAMES else (1 if ".layers." in f".{name}" else 2)
    return (rank, *(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)))


class _Checker:
    """Checks one layer's tensors against its scheme; every error names tensor, expected and actual."""

    def __init__(
        self, prefix: str, algo: QuantAlgo, tensors: dict[str, TensorInfo], why: Callable[[], str]
    ) -> None:
        self.prefix, self.algo, self.tensors, self.why = prefix, algo, tensors, why

    def fail(self, suffix: str, expected: str, actual: str) -> ValueError:
        return ValueError(
            f"tensor {self.prefix}.{suffix}: expected {expected}, got {actual} "
            f"(layer scheme {self.algo.value}: {self.why()})"
        )

    def get(self, suffix: str, required: bool = True) -> TensorInfo | None:
        info = self.tensors.get(f"{self.prefix}.{suffix}")
        if info is None and required:
            raise self.fail(suffix, "the tensor to exist", "nothing")
        return info

    def expect(self, suffix: str, codes: tuple[str, ...], shape: tuple[int, ...] | None = None) -> TensorInfo:
        info = self.get(suffix)
        assert info is not None
        if info.dtype not in codes:
            raise self.fail(suffix, "dtype " + " or ".join(codes), f"{info.dtype} {list(info.shape)}")
        if shape is not None and info.shape != shape:
            raise self.fail(suffix, f"shape {list(shape)}", f"{list(info.shape)}")
        return info

    def expect_scalar(self, suffix: str, required: bool = True) -> None:
        info = self.get(suffix, required)
        if info is None:
            return
        if info.dtype != "F32" or info.numel != 1:
            raise self.fail(suffix, "an F32 scalar (shape [] or [1])", f"{info.dtype} {list(info.shape)}")

    def absent(self, *suffixes: str) -> None:
        for s in suffixes:
            info = self.get(s, required=False)
            if info is not None:
                raise self.fail(s, "no such tensor", f"{info.dtype} {list(info.shape)}")


def _check_layer(c: _Checker) -> tuple[tuple[int, int], tuple[int, int]]:
    """Validate a layer's tensors for its scheme; return (logical [N, K], physical shape)."""
    algo = c.algo
    if algo is QuantAlgo.MXFP4:
        packed = c.expect("weight_packed", ("U8",))
        n, half = packed.shape
        k = 2 * half
        if k % MXFP4_GROUP:
            raise c.fail("weight_packed", f"a packed width K/2 with K divisible by {MXFP4_GROUP}", f"K={k}")
        c.expect("weight_scale", ("U8", "F8_E8M0"), (n, k // MXFP4_GROUP))
        c.absent("weight", "weight_scale_2", "input_scale")
        return (n, k), (n, k)
    c.absent("weight_packed")
    w = c.get("weight")
    assert w is not None
    if algo is QuantAlgo.NONE:
        c.expect("weight", _FLOAT_CODES)
        c.absent("weight_scale", "weight_scale_2", "input_scale")
        n, k = w.shape
        return (n, k), (n, k)
    if algo in (QuantAlgo.NVFP4, QuantAlgo.W4A16_NVFP4):
        c.expect("weight", ("U8",))
        n, half = w.shape
        k = 2 * half
        if k % NVFP4_GROUP:
            raise c.fail("weight", f"a packed width K/2 with K divisible by {NVFP4_GROUP}", f"K={k}")
        c.expect("weight_scale", ("F8_E4M3",), (n, k // NVFP4_GROUP))
        c.expect_scalar("weight_scale_2")
        c.expect_scalar("input_scale", required=algo is QuantAlgo.NVFP4)
        return (n, k), (n, k)
    if algo is QuantAlgo.FP8_PB_WO:
        c.expect("weight", ("F8_E4M3",))
        n, k = w.shape
        if k % FP8_BLOCK:
            raise c.fail(
                "weight",
                f"an input size K divisible by {FP8_BLOCK} (FP8_PB_WO quantizes activations in 1x128 groups "
                "and pads only N)",
                f"K={k}",
            )
        nb = -(-n // FP8_BLOCK)
        s = c.expect("weight_scale", ("F32",))
        # ModelOpt squeezes a single-tile scale to a 0-dim tensor
        if s.shape != (nb, 1, k // FP8_BLOCK, 1) and not (s.numel == 1 and nb * (k // FP8_BLOCK) == 1):
            raise c.fail("weight_scale", f"shape {[nb, 1, k // FP8_BLOCK, 1]}", f"{list(s.shape)}")
        c.absent("weight_scale_2")
        return (n, k), (nb * FP8_BLOCK, k)
    if algo is QuantAlgo.FP8:
        c.expect("weight", ("F8_E4M3",))
        c.expect_scalar("weight_scale")
        c.expect_scalar("input_scale")
        n, k = w.shape
        return (n, k), (n, k)
    raise c.fail("weight", "a supported scheme", algo.value)


def _why(
    qc: ModelOptConfig | CompressedTensorsConfig | None, algo: QuantAlgo, prefix: str, num_experts: int | None
) -> str:
    if qc is None:
        return "the checkpoint has no quantization config"
    if isinstance(qc, CompressedTensorsConfig):
        return qc.explain(prefix, algo, num_experts)
    if algo is QuantAlgo.NONE:
        if qc.is_excluded(prefix, num_experts=num_experts):
            return "matched by the exclude list"
        return "not listed in quantized_layers" if qc.is_mixed else "unquantized by the config"
    return f"from the {qc.quant_algo} config"


def build_quant_plan(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    *,
    nvfp4_as_fp8: bool = False,
    tensors: dict[str, TensorInfo] | None = None,
    problems: list[tuple[str, str]] | None = None,
) -> QuantPlan:
    """The plan of a checkpoint directory from config.json and the safetensors headers (no tensor data).

    nvfp4_as_fp8: report NVFP4 linears as load_model(nvfp4_as_fp8=True) runs them on CUDA (the FP8 copy
    where quant/schemes.py's rule picks it; CPU always runs the reference).
    tensors: the headers, when the caller has read them already.

    Raises ValueError naming the tensor, expected and actual when the config and the tensors disagree; with
    `problems` given, every such layer's (prefix, error) is appended there instead and the layer left out of
    the plan (k3run.checks lists them all).
    """
    model_dir = Path(model_dir)
    if tensors is None:
        tensors = read_checkpoint_headers(model_dir)
    qc = load_quant_config(model_dir, tensors=tensors)
    device_name = str(torch.device(device))
    prefixes = sorted(
        {
            n.rpartition(".")[0]
            for n, t in tensors.items()
            if n.rpartition(".")[2] in ("weight", "weight_packed") and len(t.shape) == 2
        },
        key=_model_order,
    )
    experts = _expert_counts(prefixes)
    owned: set[str] = set()
    layers: list[LayerPlan] = []
    bank_algos: dict[str, QuantAlgo] = {}
    for prefix in prefixes:
        names = tuple(f"{prefix}.{s}" for s in LAYER_SUFFIXES if f"{prefix}.{s}" in tensors)
        owned.update(names)
        is_embedding = prefix.rpartition(".")[2] in _EMBEDDING_NAMES
        bank = expert_bank(prefix)
        n_experts = experts.get(bank) if bank is not None else None
        algo = _layer_algo(qc, prefix, is_embedding, bank, n_experts, bank_algos)
        if is_embedding:
            why: Callable[[], str] = lambda: "embeddings are never quantized"
        else:
            why = functools.partial(_why, qc, algo, prefix, n_experts)
        try:
            logical, physical = _check_layer(_Checker(prefix, algo, tensors, why))
        except ValueError as e:
            if problems is None:
                raise
            problems.append((prefix, str(e)))
            continue
        kind = "embedding" if is_embedding else ("expert" if _EXPERT.match(prefix) else "linear")
        layers.append(
            LayerPlan(
                prefix=prefix,
                kind=kind,
                algo=algo,
                logical_shape=logical,
                physical_shape=physical,
                nbytes=sum(tensors[n].nbytes for n in names),
                implementation=_implementation(algo, device_name, kind, logical, nvfp4_as_fp8),
                tensors=names,
            )
        )
    others = [t for n, t in tensors.items() if n not in owned]
    model_dtype, notes = _held_dtypes(model_dir, qc, tensors)
    config_notes = tuple(qc.notes()) if isinstance(qc, CompressedTensorsConfig) else ()
    return QuantPlan(
        model_dir=model_dir,
        device=device_name,
        quant_config=qc,
        layers=tuple(layers),
        other_tensors=len(others),
        other_bytes=sum(t.nbytes for t in others),
        model_dtype=model_dtype,
        held_dtype_notes=notes,
        config_notes=config_notes,
    )


def _held_dtypes(
    model_dir: Path, qc: ModelOptConfig | CompressedTensorsConfig | None, tensors: dict[str, TensorInfo]
) -> tuple[str | None, tuple[str, ...]]:
    """For a Kimi checkpoint, the model built on the meta device (no memory) says which dtype each float
    tensor is held in, exactly as load_model holds it; other model types have no notes."""
    import json

    from k3run.api import checkpoint_dtype
    from k3run.config import ModelConfig
    from k3run.models.kimi import KimiForCausalLM, held_dtype_notes

    path = model_dir / "config.json"
    hf = json.loads(path.read_text()) if path.is_file() else {}
    if hf.get("model_type") not in ("kimi_linear", "kimi_k3"):
        return None, ()
    try:
        dtype = checkpoint_dtype(hf, model_dir)
        with torch.device("meta"):
            model = KimiForCausalLM(ModelConfig.from_hf(hf), qcfg=qc, params_dtype=dtype)
    except ValueError as e:  # the plan is still useful; the table says why this part is missing
        return "(unknown)", (f"not computed: the model cannot be built from {path}: {e}",)
    return str(dtype).removeprefix("torch."), tuple(held_dtype_notes(model.held_dtypes(tensors), dtype))


def _expert_counts(prefixes: list[str]) -> dict[str, int]:
    """Each routed-expert bank's expert count, as its expert ids in the headers show it."""
    experts: dict[str, int] = defaultdict(int)
    for prefix in prefixes:
        m = _EXPERT.match(prefix)
        if m is not None:
            bank = m.group(1)[:-1]
            experts[bank] = max(experts[bank], int(m.group(2)) + 1)
    return experts


def _layer_algo(
    qc: QuantConfig | None, prefix: str, is_embedding: bool, bank: str | None, n_experts: int | None,
    bank_algos: dict[str, QuantAlgo],
) -> QuantAlgo:  # fmt: skip
    """The layer's algorithm as load_model resolves it: embeddings and unquantized checkpoints NONE; a routed
    expert as its bank, resolved once per bank (a bank's resolution looks at every expert's names: K3 has
    896 experts x 3 projections per bank)."""
    if is_embedding or qc is None:
        return QuantAlgo.NONE
    if bank is not None:
        if bank not in bank_algos:
            bank_algos[bank] = qc.resolve(prefix, num_experts=n_experts)
        return bank_algos[bank]
    return qc.resolve(prefix, num_experts=n_experts)


def _implementation(
    algo: QuantAlgo, device_name: str, kind: str, logical: tuple[int, ...], nvfp4_as_fp8: bool
) -> str:
    """The kernel the layer runs on `device_name` (with `nvfp4_as_fp8`, NVFP4 linears on CUDA report the FP8
    copy where quant/schemes.py's rule picks it)."""
    if kind == "embedding":
        return "embedding lookup"
    impl = implementation_name(algo, device_name, kind)
    nvfp4 = algo in (QuantAlgo.NVFP4, QuantAlgo.W4A16_NVFP4)
    if nvfp4_as_fp8 and nvfp4 and kind == "linear" and torch.device(device_name).type == "cuda":
        impl = nvfp4_fp8_implementation(*logical) or impl
    return impl
