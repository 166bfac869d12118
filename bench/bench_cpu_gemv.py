"""The fast CPU linears against the references they replace (dequantize the whole weight to fp32, then
matmul), on this machine's cores: NVFP4 W4A16 (kernels/nvfp4_gemm/cpu.py) and FP8_PB_WO
(kernels/fp8_gemm/cpu.py); up to cpu_fused.MAX_M rows the AVX-512 extension (kernels/cpu_simd.py)
where the CPU has it, else the compiled fused GEMV (kernels/cpu_fused.py; timed too, as "loop ms"), above
MAX_M the compiled dequantization in row blocks + matmul. --decode also times whole decode steps of a reduced
K3-shaped model (bench/k3_shaped.py, k3-mixed: NVFP4 experts, FP8_PB_WO attention): the default paths in fp32
and bf16, the compiled loops alone, and the references.

Per format, shape and M: the default path's time, its weight bytes (NVFP4: codes + E4M3 scales; FP8: bytes +
tile scales) per second and as % of the memory copy rate measured in the same run (the ceiling for a kernel
that only streams its weights), the reference's time (the baseline) and the speed-up; for scale, the time of
a dense fp32 and a bf16 GEMV of the same shape (weights kept decoded). Median of 7 calls after a warm-up (the
first call compiles / builds).

    PYTHONPATH=src python bench/bench_cpu_gemv.py [--shapes 7168x7168,3072x3584,4096x1024] [--ms 1,4,64]
        [--dtype bfloat16] [--decode]
"""

# ruff: noqa: B023

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from k3run.formats import quantize_fp8_block, quantize_nvfp4
from k3run.kernels import cpu_fused, cpu_simd
from k3run.kernels.fp8_gemm.cpu import fp8_pb_wo_linear_cpu
from k3run.kernels.fp8_gemm.ref import fp8_pb_wo_linear_ref
from k3run.kernels.nvfp4_gemm.cpu import nvfp4_linear_cpu
from k3run.kernels.nvfp4_gemm.ref import nvfp4_linear_ref
from k3run.knobs import reset_knobs


def _ms(fn, reps: int = 7) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_gbs() -> float:
    """Bytes read + written per second by a 512 MiB tensor copy."""
    a = torch.empty(2**29, dtype=torch.uint8).random_()
    b = torch.empty_like(a)
    return 2 * a.numel() / _ms(lambda: b.copy_(a)) / 1e6


def _decode(steps: int = 12) -> None:
    """ms per decode step of a reduced K3-shaped model: the default paths (AVX-512 extension where the CPU
    has it, else the compiled loops) in fp32 and bf16, the compiled loops alone, and the references (fp32)."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from k3_shaped import random_k3_model

    from k3run.engine import LLM, EngineConfig, SamplingParams
    from k3run.tokenizer import load_tokenizer

    dims = {"vocab_size": 32000, "hidden_size": 2048, "num_heads": 16, "q_lora_rank": 512, "top_k": 4,
            "moe_intermediate_size": 1024, "routed_expert_hidden_size": 1024}  # fmt: skip
    tok = load_tokenizer(os.path.join(os.path.dirname(__file__), "..", "assets", "default-model-k3-mixed"))
    print("reduced K3-shaped model: 4 layers (3 KDA + 1 MLA), hidden 2048, 16 experts of 1024x1024")
    modes = [("fast", torch.float32, ""), ("fast", torch.bfloat16, ""), ("loop", torch.bfloat16, "0"),
             ("reference", torch.float32, "")]  # fmt: skip
    if cpu_simd.cpu_level() == "avx512":
        modes.insert(2, ("avx2", torch.bfloat16, "avx2"))
    for what, dtype, avx in modes:
        saved = cpu_fused.MIN_WEIGHTS
        cpu_fused.MIN_WEIGHTS = 1 << 62 if what == "reference" else saved  # also decides the experts' path
        os.environ["K3RUN_CPU_SIMD"] = avx
        reset_knobs()
        try:
            model = random_k3_model(layers=4, experts=16, device="cpu", dtype=dtype, dims=dims)
            eng = LLM.from_model(model, tok, EngineConfig(max_num_seqs=4, max_model_len=256)).engine
            for b in (1, 4):
                for _ in range(b):
                    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
                    eng.add_request(list(range(100, 132)), params)
                eng.step()
                walls = []
                while eng.has_unfinished():
                    t0 = time.perf_counter()
                    eng.step()
                    walls.append((time.perf_counter() - t0) * 1e3)
                name = f"{what} {str(dtype).removeprefix('torch.')}"
                print(f"  {name:>16} batch {b}: {statistics.median(walls[1:]):7.1f} ms per step", flush=True)
        finally:
            cpu_fused.MIN_WEIGHTS = saved
            os.environ.pop("K3RUN_CPU_SIMD")
            reset_knobs()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="7168x7168,3072x3584,4096x1024")
    ap.add_argument("--ms", default="1,4,64")
    ap.add_argument("--decode", action="store_true", help="decode steps of a reduced K3-shaped model too")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the inputs' dtype")
    args = ap.parse_args()
    torch.manual_seed(0)
    copy = copy_gbs()
    saved, cpu_fused.MIN_WEIGHTS = cpu_fused.MIN_WEIGHTS, 0  # the compiled loops at every size asked for
    isa = torch.backends.cpu.get_cpu_capability()
    print(f"{torch.get_num_threads()} threads, {isa}, copy {copy:.1f} GB/s, {args.dtype} inputs")
    avx = cpu_simd.available()
    level = cpu_simd.cpu_level()
    print(f"SIMD extension: {level if avx else 'off'} {cpu_simd._error or ''}")
    head = f"{'fmt':>5} {'shape':>11} {'M':>2} {'fast ms':>8} {'GB/s':>6} {'%copy':>6} {'avx2 ms':>8}"
    head += f" {'loop ms':>8}"
    head += f" {'ref ms':>8}"
    print(f"{head} {'speed-up':>8} {'fp32 ms':>8} {'bf16 ms':>8} {'rel err':>8}")
    # every lambda below is timed inside its own loop iteration
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        q = quantize_nvfp4(torch.randn(n, k))
        w, s, gs = q.weight, q.weight_scale, q.weight_scale_2.reshape(1).float()
        q8, s8 = quantize_fp8_block(torch.randn(n, k))
        s8 = s8.reshape(s8.shape[0], s8.shape[2])
        dense = torch.randn(n, k)
        dense_bf16 = dense.bfloat16()
        cases = [
            ("nvfp4", w.numel() + s.numel(), lambda x: nvfp4_linear_cpu(x, w, s, gs),
             lambda x: nvfp4_linear_ref(x, w, s, gs)),
            ("fp8", q8.numel() + 4 * s8.numel(), lambda x: fp8_pb_wo_linear_cpu(x, q8, s8, n),
             lambda x: fp8_pb_wo_linear_ref(x, q8, s8, n)),
        ]  # fmt: skip
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k).to(getattr(torch, args.dtype))
            t32 = _ms(lambda: x.float() @ dense.t())
            t16 = _ms(lambda: x.bfloat16() @ dense_bf16.t())
            for fmt, nbytes, fast, ref in cases:
                t_fast = _ms(lambda: fast(x))
                t_avx2 = float("nan")
                if level == "avx512":  # the AVX2 kernels on the same CPU (what AVX2-only CPUs run)
                    os.environ["K3RUN_CPU_SIMD"] = "avx2"
                    reset_knobs()
                    t_avx2 = _ms(lambda: fast(x))
                os.environ["K3RUN_CPU_SIMD"] = "0"  # the compiled loop (what runs without the extension)
                reset_knobs()
                t_loop = _ms(lambda: fast(x))
                os.environ.pop("K3RUN_CPU_SIMD")
                reset_knobs()
                t_ref = _ms(lambda: ref(x), reps=3)
                want = ref(x)
                err = float((fast(x).float() - want.float()).norm() / want.float().norm())
                gbs = nbytes / t_fast / 1e6
                row = f"{fmt:>5} {shape:>11} {m:>2} {t_fast:>8.2f} {gbs:>6.2f} {100 * gbs / copy:>5.1f}%"
                row += f" {t_avx2:>8.2f} {t_loop:>8.2f}"
                row += f" {t_ref:>8.2f} {t_ref / t_fast:>7.1f}x {t32:>8.2f} {t16:>8.2f} {err:>8.1e}"
                print(row, flush=True)
    cpu_fused.MIN_WEIGHTS = saved
    if cpu_fused.disabled:
        print(f"NOTE: the compiled paths were disabled: {cpu_fused.disabled}")
    if args.decode:
        _decode()


if __name__ == "__main__":
    main()
