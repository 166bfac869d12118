"""Write a random Kimi Linear 48B-A3B checkpoint to disk in the published layout: the tensor names, shapes
and dtypes of moonshotai/Kimi-Linear-48B-A3B-Instruct (configs/kimi_linear_48b_a3b.tensor-table.json, its 35
name patterns expanded to the 20,493 tensors) with its config.json, either as bf16 or quantized as ModelOpt
writes it (quant/export.py `quantize_tensors`, recipe nvfp4 / fp8_pb_wo / k3-mixed).

Values are generated per tensor when its group is written (seeded by name, on `--device`; a CUDA device
quantizes there), so the full model streams through memory a group at a time: the NVFP4 form needs ~29 GB
of disk, bf16 ~92 GB. Weights are N(0, 1/K) (unit-scale activations through each linear), norms ones,
the KDA A_log log(U(1, 16)), dt_bias small, router biases zero.

    PYTHONPATH=src python3 bench/write_kimi_linear.py DST [--recipe nvfp4|bf16|...] [--device cuda]
        [--layers N] [--experts N] [--vocab N]      # the last three shrink it (smoke tests)
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
import zlib
from pathlib import Path

import torch

CONFIGS = Path(__file__).resolve().parent / "configs"
DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32}


def _ranges(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def expand(table: dict, layers: int | None = None, experts: int | None = None, vocab: int | None = None):
    """The table's rows as {name: (shape, safetensors dtype)}, optionally cut to the first `layers` layers,
    `experts` experts and a `vocab`-row embedding / lm_head."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for row in table["rows"]:
        shape, dtype = tuple(row["shape"]), row["dtype"]
        if vocab is not None and row["pattern"] in ("lm_head.weight", "model.embed_tokens.weight"):
            shape = (vocab, *shape[1:])
        if experts is not None and ".block_sparse_moe.gate." in row["pattern"]:  # the router's rows
            shape = (experts, *shape[1:])
        spec = row["layers"]
        if spec is None:
            names = [row["pattern"]]
            m = re.match(r"model\.layers\.(\d+)\.", row["pattern"])
            if m and layers is not None and int(m.group(1)) >= layers:
                names = []
        else:
            lspec, _, espec = spec.partition("|")
            ls = [i for i in _ranges(lspec) if layers is None or i < layers]
            es = [e for e in _ranges(espec[1:]) if experts is None or e < experts] if espec else [None]
            names = [row["pattern"].replace("{L}", str(i)).replace("{E}", str(e)) for i in ls for e in es]
        for name in names:
            out[name] = (shape, dtype)
    return out


def value(name: str, shape: tuple[int, ...], dtype: str, device: str) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
    kw = dict(generator=g, device=device)
    if name.endswith("A_log"):
        return torch.log(1 + 15 * torch.rand(shape, **kw)).to(DTYPES[dtype])
    if name.endswith("dt_bias"):
        return (torch.rand(shape, **kw) * 0.1 - 0.05).to(DTYPES[dtype])
    if name.endswith("e_score_correction_bias"):
        return torch.zeros(shape, dtype=DTYPES[dtype], device=device)
    if re.search(r"(norm|layernorm)\.weight$", name):
        return torch.ones(shape, dtype=DTYPES[dtype], device=device)
    fan_in = math.prod(shape[1:]) or 1
    return (torch.randn(shape, **kw) / math.sqrt(fan_in)).to(DTYPES[dtype])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dst", type=Path)
    ap.add_argument(
        "--recipe", default="nvfp4", help="bf16, or a quantize recipe (nvfp4, fp8_pb_wo, k3-mixed)"
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--experts", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--max-shard-gib", type=float, default=5.0)
    args = ap.parse_args()
    from k3run.quant.export import _ShardWriter, quantize_tensors
    from k3run.safetensors_io import TensorInfo

    table = json.loads((CONFIGS / "kimi_linear_48b_a3b.tensor-table.json").read_text())
    config = json.loads((CONFIGS / "kimi_linear_48b_a3b.json").read_text())
    config.pop("quantization_config", None)
    tensors = expand(table, args.layers, args.experts, args.vocab)
    if args.layers is not None:
        config["num_hidden_layers"] = args.layers
        for key in ("kda_layers", "full_attn_layers"):
            la = config.get("linear_attn_config", {})
            if key in la:  # 1-based layer numbers
                la[key] = [i for i in la[key] if i <= args.layers]
    if args.experts is not None:
        config["num_experts"] = args.experts
        config["num_experts_per_token"] = min(config["num_experts_per_token"], args.experts)
    if args.vocab is not None:
        config["vocab_size"] = args.vocab
    infos = {
        n: TensorInfo(n, dt, shape, Path(""), (0, math.prod(shape) * DTYPES[dt].itemsize))
        for n, (shape, dt) in tensors.items()
    }
    params = sum(math.prod(s) for s, _ in tensors.values())
    print(f"{len(tensors)} tensors, {params:,} parameters -> {args.dst} ({args.recipe}, on {args.device})")
    if args.dst.exists() and any(args.dst.iterdir()):
        raise SystemExit(f"{args.dst}: exists and is not empty")
    args.dst.mkdir(parents=True, exist_ok=True)
    get = lambda name: value(name, *tensors[name], args.device)  # noqa: E731
    t0 = time.perf_counter()
    max_bytes = int(args.max_shard_gib * (1 << 30))
    if args.recipe == "bf16":
        out = _ShardWriter(args.dst, max_bytes)
        for name in tensors:
            out.add(name, get(name))
        out.finish()
        (args.dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    else:
        quantize_tensors(infos, get, config, args.dst, args.recipe, max_shard_bytes=max_bytes)
    size = sum(f.stat().st_size for f in args.dst.iterdir())
    print(f"wrote {size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
