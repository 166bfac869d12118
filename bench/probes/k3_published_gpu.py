"""Question: do both published K3 layouts load on a GPU and decode through the engine (CUDA graphs) as on
the CPU?

Answer (bench/RESULTS.md "Runs 78-81", runs 78-79): yes, once the MXFP4 experts' load on CUDA (a device
mismatch in the cast, found by this probe in run 78) was fixed: MXFP4 logits 1.74e-02 from fp32 on the CPU,
greedy 24/24 tokens as the CPU engine, 842.7 tok/s; NVFP4 1.55e-01, 10/24, 752.3 tok/s (its FP8 activations
on random weights, 0.14-0.31 from fp32 on the CPU in bf16 too). tests/models/test_k3_published.py's GPU test
now covers the load.

The reduced K3 in both published layouts (tests/k3_published.py: moonshotai/Kimi-K3's MXFP4
compressed-tensors, nvidia/Kimi-K3-NVFP4's ModelOpt MIXED_PRECISION) written to disk, loaded on a device and
run: logits against the same checkpoint on the CPU in fp32, then greedy decode through the engine (CUDA graphs
where they apply) against the CPU engine's tokens.

    python bench/probes/k3_published_gpu.py [--device cuda] [--tokens 24]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from k3run.api import load_model  # noqa: E402
from k3run.engine import LLM, EngineConfig, SamplingParams  # noqa: E402
from k3run.testing import rel_rms_error  # noqa: E402
from tests import k3_published  # noqa: E402


class _Ids:
    """Token ids in and out: the reduced model has no tokenizer."""

    eos_token_id = None
    eos_token_ids: tuple[int, ...] = ()
    chat_template = None
    vocab_size = k3_published.DIMS["vocab_size"]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    ids = torch.randint(1, 500, (37,), generator=torch.Generator().manual_seed(1))
    print(f"{'layout':<7} {'load s':>7} {'logits rel err':>15} {'greedy = cpu':>13} {'decode tok/s':>13}")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("mxfp4", "nvfp4"):
            d = k3_published.write(Path(tmp) / kind, kind)
            ref = load_model(d, dtype=torch.float32).logits(ids)
            t0 = time.perf_counter()
            model = load_model(d, dtype=torch.bfloat16, device=args.device)
            load_s = time.perf_counter() - t0
            out = model.logits(ids.to(args.device)).float().cpu()
            err = rel_rms_error(ref, out)
            cfg = EngineConfig(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=128)
            sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
            prompt = ids[:12].tolist()
            llm = LLM.from_model(model, _Ids(), cfg)
            llm.generate([prompt], sp)  # warm-up: graph capture
            t0 = time.perf_counter()
            got = llm.generate([prompt], sp)[0].token_ids
            rate = (len(got) - 1) / (time.perf_counter() - t0)
            cpu = LLM.from_model(load_model(d, dtype=torch.bfloat16), _Ids(), cfg).generate([prompt], sp)
            same = sum(a == b for a, b in zip(got, cpu[0].token_ids))
            print(f"{kind:<7} {load_s:>7.2f} {err:>15.2e} {same:>6}/{len(got):<6} {rate:>13.1f}")


if __name__ == "__main__":
    main()
