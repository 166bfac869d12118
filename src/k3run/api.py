"""The small public API: `load_model(path)` returns a ready KimiForCausalLM (bf16, ModelOpt-quantized, or
moonshotai/Kimi-K3's compressed-tensors MXFP4 experts; original or transformers-5 tensor naming)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from k3run.checks import check_headers
from k3run.config import ModelConfig
from k3run.distributed import TPInfo
from k3run.loader import load_checkpoint
from k3run.models.kimi import KimiForCausalLM
from k3run.quant.compressed_tensors import CompressedTensorsConfig
from k3run.quant.experts import NvFp4ActMode
from k3run.quant.modelopt import load_quant_config
from k3run.quant.schemes import enable_nvfp4_fp8_blocks
from k3run.safetensors_io import TensorInfo, read_checkpoint_headers

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def checkpoint_dtype(hf: dict, path: Path) -> torch.dtype:
    """The activation dtype a checkpoint's config.json names (`dtype` / `torch_dtype`, also under
    text_config), bf16 when it names none."""
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    name = (
        hf.get("dtype") or hf.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype") or "bfloat16"
    )
    if name not in _DTYPES:
        raise ValueError(f"{path / 'config.json'}: dtype {name!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def load_model(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    tp_rank: int = 0,
    tp_size: int = 1,
    *,
    tp_group: object = None,
    nvfp4_moe_act: NvFp4ActMode = "w4a16",
    nvfp4_as_fp8: bool = False,
    progress: bool = False,
) -> KimiForCausalLM:
    """Build the model described by `path`/config.json and stream its safetensors weights into it.

    dtype: activation / unquantized-parameter dtype (default: the checkpoint's `dtype`, else bf16).
    tp_rank / tp_size: this process's place in an already initialised torch.distributed group (tp_group,
    default the world group). nvfp4_moe_act: NVFP4 experts as W4A16 (activations stay 16-bit, the Hopper
    path) or "w4a4" (activations quantize-dequantized to NVFP4 like the Blackwell kernels).
    nvfp4_as_fp8: also convert NVFP4 linear weights to FP8 128x128 blocks at load and run them on FP8
    tensor cores for the shapes where that is measured faster (quant/schemes.py `nvfp4_fp8_faster`; sm90
    only, a no-op on CPU). Lossy: ~3e-2 relative weight error on top of NVFP4. Routed experts keep NVFP4.

    A checkpoint that does not fit its config, or holds invalid values, raises k3run.checks.CheckpointInvalid
    (a ValueError) listing every problem found, in checkpoint tensor and config field names.
    """
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face checkpoint directory)")
    hf = json.loads(cfg_path.read_text())
    cfg = ModelConfig.from_hf(hf)
    tensors = read_checkpoint_headers(path)  # once: ~15 s at K3's ~1M tensors on a 2-core machine
    qcfg = load_quant_config(path, tensors=tensors)
    # the headers against the config and the quant schemes, before the model is built (k3run.checks);
    # the scale values and the weights are checked by load_checkpoint
    check_headers(path, hf=hf, cfg=cfg, tensors=tensors)
    if tp_size > 1 and not torch.distributed.is_initialized():
        raise ValueError(
            f"load_model: tp_size={tp_size} needs an initialised torch.distributed process group "
            "(k3run.distributed.init_distributed() under torchrun)"
        )
    tp = TPInfo(tp_rank, tp_size, tp_group)
    dtype = dtype or checkpoint_dtype(hf, path)
    with torch.device(device):
        model = KimiForCausalLM(cfg, qcfg=qcfg, tp=tp, params_dtype=dtype, nvfp4_moe_act=nvfp4_moe_act)
    if isinstance(qcfg, CompressedTensorsConfig):
        log.info("%s", qcfg.summary())
        for note in qcfg.notes():
            log.info("%s", note)
    load_checkpoint(model, path, model.checkpoint_mapping, tp=tp, progress=progress, infos=tensors)
    _log_held_dtypes(model, tensors, dtype)
    if nvfp4_as_fp8:
        converted = enable_nvfp4_fp8_blocks(model)
        log.info("nvfp4_as_fp8: %d NVFP4 linear layers also hold FP8 128x128 blocks", len(converted))
    if torch.device(device).type == "cpu":
        _prepare_cpu_kernels(model)
    return model.eval()


def _log_held_dtypes(model: KimiForCausalLM, tensors: dict[str, TensorInfo], dtype: torch.dtype) -> None:
    """Say which checkpoint tensors are held in a dtype other than the model's (e.g. K3's F32 o_norm, A_log,
    conv weights: fp32) and warn about any that loading rounded."""
    groups = model.held_dtypes(tensors)
    for g in groups:
        if g.rounded:
            log.warning("checkpoint tensors rounded at load: %s", g.describe())
    kept = [g.describe() for g in groups if not g.rounded and g.held != dtype]
    if kept:
        log.info(
            "held in another dtype than the model's %s: %s",
            str(dtype).removeprefix("torch."),
            "; ".join(kept),
        )


def _prepare_cpu_kernels(model: torch.nn.Module) -> None:
    """Build (or load from its cache) the AVX-512 / AVX2 CPU extension now if any quantized matrix will use
    it, so the ~20 s first build lands in loading, not in the first request."""
    from k3run.kernels import cpu_fused, cpu_simd

    for name, p in model.named_parameters():
        if p.dim() < 2 or p.element_size() != 1 or not name.endswith("weight"):  # NVFP4 codes / FP8 bytes
            continue
        weights = p.shape[-2] * p.shape[-1] * (2 if p.dtype == torch.uint8 else 1)  # two codes per byte
        if weights >= cpu_fused.MIN_WEIGHTS:
            cpu_simd.available()
            return
