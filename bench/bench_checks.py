"""What the checkpoint checks (k3run.checks) cost: each stage on a checkpoint directory, and stage 3's screen
throughput on the device.

  python bench/bench_checks.py [DIR]              # default: the bundled assets/default-model-k3-mixed
  python bench/bench_checks.py --screen-gib 8     # the screen over synthetic bf16 / fp8 / e4m3-scale
                                                  # parameters on CUDA (or the CPU), GB/s per kind
  python bench/bench_checks.py --k3-headers       # stage 1 on synthetic headers of nvidia/Kimi-K3-NVFP4
                                                  # (its real config and quant config, ~992k tensors)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from k3run import checks
from k3run.api import load_model
from k3run.config import ModelConfig
from k3run.safetensors_io import read_checkpoint_headers

ROOT = Path(__file__).resolve().parents[1]


def _best(fn, repeat: int = 5) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def stages(d: Path) -> None:
    hf = json.loads((d / "config.json").read_text())
    cfg = ModelConfig.from_hf(hf)
    tensors = read_checkpoint_headers(d)
    nbytes = sum(t.nbytes for t in tensors.values())
    print(f"{d}: {len(tensors)} tensors, {nbytes / 2**20:.2f} MiB")
    t = _best(lambda: checks.header_problems(d, hf=hf, cfg=cfg, tensors=tensors))
    print(f"  stage 1, headers vs config and schemes: {t * 1e3:.1f} ms")
    t = _best(lambda: checks._dry_run(d, cfg), repeat=3)
    print(f"  inspect's loader dry run (meta model, no data): {t * 1e3:.1f} ms")
    for blocks in (False, True):
        stats: dict[str, int] = {}
        t = _best(lambda: checks.scale_value_problems(tensors, block_scales=blocks, stats=stats))  # noqa: B023
        what = "every scale (inspect)" if blocks else "fp32 scales (load)"
        print(f"  stage 2, {what}: {t * 1e3:.1f} ms, {stats.get('bytes', 0) / 2**10:.1f} KiB read per run")
    model = load_model(d)
    params = dict(model.named_parameters())
    screened = sum(p.numel() * p.element_size() for p in params.values() if p.dtype != torch.uint8)
    t = _best(lambda: checks.screen_parameters(params))
    print(
        f"  stage 3, screen of {len(params)} parameters ({screened / 2**20:.2f} MiB read): {t * 1e3:.2f} ms"
    )


def screen_throughput(gib: float, device: str) -> None:
    n = int(gib * 2**30)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    kinds = {
        "bf16 weight": torch.empty(n // 2, dtype=torch.bfloat16, device=device).normal_(),
        "fp8 weight": torch.randint(0, 0x7E, (n,), dtype=torch.uint8, device=device).view(
            torch.float8_e4m3fn
        ),
        "e4m3 block scale": torch.randint(1, 0x7E, (n,), dtype=torch.uint8, device=device).view(
            torch.float8_e4m3fn
        ),
    }
    for kind, x in kinds.items():
        name = "w.weight_scale" if "scale" in kind else "w.weight"
        checks.screen_parameters({name: x})  # warm-up
        sync()

        def run() -> None:
            checks.screen_parameters({name: x})  # noqa: B023
            sync()

        t = _best(run)
        print(
            f"  {kind}: {gib:.1f} GiB in {t * 1e3:.2f} ms = {x.numel() * x.element_size() / t / 1e9:.0f} GB/s"
        )
    # many small parameters: the per-parameter launch cost, one sync for all of them
    small = {f"p{i}.weight": torch.zeros(4096, dtype=torch.bfloat16, device=device) for i in range(2000)}
    checks.screen_parameters(small)
    t = _best(lambda: checks.screen_parameters(small))
    print(f"  2000 small bf16 parameters: {t * 1e3:.2f} ms ({t / 2000 * 1e6:.1f} us per parameter)")


def k3_headers() -> None:
    """Stage 1 at K3 scale: every tensor nvidia/Kimi-K3-NVFP4 has by its config and quant config, as headers
    (no files), through config_problems and the plan's layer checks."""
    import shutil
    import tempfile

    from k3run.quant.algo import QuantAlgo
    from k3run.quant.modelopt import expert_bank, load_quant_config
    from k3run.quant.plan import build_quant_plan
    from k3run.safetensors_io import TensorInfo

    real = ROOT / "tests" / "fixtures" / "real_checkpoints"
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        shutil.copy(real / "nvidia-Kimi-K3-NVFP4.config.json", d / "config.json")
        shutil.copy(real / "nvidia-Kimi-K3-NVFP4.hf_quant_config.json", d / "hf_quant_config.json")
        hf = json.loads((d / "config.json").read_text())
        cfg = ModelConfig.from_hf(hf)
        qc = load_quant_config(d)
        style = checks._Style(["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight"])
        tensors: dict[str, TensorInfo] = {}
        algos: dict[str, QuantAlgo] = {}

        def add(name: str, code: str, shape: tuple[int, ...]) -> None:
            tensors[name] = TensorInfo(name, code, shape, d / "model.safetensors", (0, 0))

        for key, e in checks.expected_tensors(cfg, checks._Fields(hf, cfg)).items():
            if e.alternative == "split":  # the release has q/k/v_conv1d
                continue
            m = checks._LAYER.match(key)
            name = style.render(key, m is not None and cfg.is_moe_layer(int(m.group(1))))
            shape = tuple(x.size for x in e.shapes[-1 if key.endswith("A_log") else 0])
            if not e.linear:
                add(name, "F32" if key.endswith(("A_log", "dt_bias", "bias")) else "BF16", shape)
                continue
            prefix = name.removesuffix(".weight")
            bank = expert_bank(prefix) or prefix
            if bank not in algos:
                algos[bank] = qc.resolve(prefix, num_experts=cfg.num_experts if bank != prefix else None)
            n, k = shape
            if algos[bank] in (QuantAlgo.NVFP4, QuantAlgo.W4A16_NVFP4):
                add(name, "U8", (n, k // 2))
                add(prefix + ".weight_scale", "F8_E4M3", (n, k // 16))
                add(prefix + ".weight_scale_2", "F32", ())
                add(prefix + ".input_scale", "F32", ())
            elif algos[bank] is QuantAlgo.FP8_PB_WO:
                add(name, "F8_E4M3", (n, k))
                add(prefix + ".weight_scale", "F32", (-(-n // 128), 1, k // 128, 1))
            else:
                add(name, "BF16", (n, k))
        print(f"nvidia/Kimi-K3-NVFP4 as {len(tensors)} synthetic header entries")
        t0 = time.perf_counter()
        found = checks.config_problems(hf, cfg, tensors)
        print(f"  config_problems: {time.perf_counter() - t0:.1f} s, {len(found)} problems")
        errors: list[tuple[str, str]] = []
        t0 = time.perf_counter()
        build_quant_plan(d, tensors=tensors, problems=errors)
        print(f"  layer checks (quant/plan.py): {time.perf_counter() - t0:.1f} s, {len(errors)} problems")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", nargs="?", default=str(ROOT / "assets" / "default-model-k3-mixed"))
    p.add_argument("--screen-gib", type=float, default=0.0, help="also time the screen on GiB-sized tensors")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--k3-headers", action="store_true", help="stage 1 on synthetic K3-NVFP4 headers")
    args = p.parse_args()
    if args.k3_headers:
        k3_headers()
    elif args.screen_gib:
        print(f"screen throughput on {args.device}:")
        screen_throughput(args.screen_gib, args.device)
    else:
        stages(Path(args.dir))


if __name__ == "__main__":
    main()
