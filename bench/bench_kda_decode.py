"""KDA's one-launch decode step (kernels/kda/decode.py) against the three-launch chain it replaces (the conv
in the cache pool, fla's in-place `fused_recurrent_kda`, the gated RMSNorm), at Kimi Linear's and K3's widths.

us per call, both timed in CUDA graphs (common.graph_ms) rotating over pool copies that overflow the L2, so
the states come from DRAM as in a full-depth step; the ceiling is the states read and written once at the copy
bandwidth measured in the same run; "rel RMS" compares the two outputs (bf16). Needs CUDA and fla-core.

--variants times the fused kernel with other (value columns a program / warps [/ the flat window shift])
than the kernel's default 32 / 4 / flat (e.g. 32/4: the same launch with the [channels, W - 1] block shift;
the layer takes 64/4/flat from 1024 (sequence, head) pairs, `layers.kda.fused_form`).

    python3 bench/bench_kda_decode.py [--batches 1,8,32] [--heads 32,96] [--variants 16/4/flat,32/4]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

from k3run.kernels.kda import causal_conv1d_decode_in_place, kda_decode_in_place
from k3run.kernels.kda.decode import kda_decode_fused_triton
from k3run.knobs import Knobs
from k3run.layers.kda import fused_form_kwargs
from k3run.layers.norm import gated_rms_norm
from k3run.testing import rel_rms_error

sys.path.insert(0, str(Path(__file__).parent))
from common import copies_for, copy_bandwidth, graph_ms  # noqa: E402

K, W = 128, 4


def _inputs(B: int, H: int, copies: int, lower_bound: float | None) -> tuple[dict, list, list]:
    g = torch.Generator(device="cuda").manual_seed(0)
    P = H * K

    def rnd(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)

    proj = rnd(B, 3 * P + H + K, dtype=torch.bfloat16)  # q | k | v | b | f_a, as Kimi Linear's in_proj
    common = dict(
        qkv=proj[:, : 3 * P], b=proj[:, 3 * P : 3 * P + H], f=rnd(B, P, dtype=torch.bfloat16),
        gate=rnd(B, P, dtype=torch.bfloat16), conv_weight=rnd(3 * P, W, scale=0.5), A_log=rnd(H, scale=0.5),
        dt_bias=rnd(P, scale=0.5), lower_bound=lower_bound, scale=K**-0.5,
        slots=torch.arange(B, device="cuda"), context_lens=torch.full((B,), 7, device="cuda"),
        norm_weight=rnd(K).abs() + 0.5, eps=1e-6,
    )  # fmt: skip
    convs = [rnd(B, 3 * P, W - 1, dtype=torch.bfloat16) for _ in range(copies)]
    states = [rnd(B, H, K, K, scale=0.05) for _ in range(copies)]
    return common, convs, states


def _chain(c: dict, conv_pool: torch.Tensor, state_pool: torch.Tensor) -> torch.Tensor:
    B, H = c["b"].shape
    q, k, v = causal_conv1d_decode_in_place(
        c["qkv"], c["conv_weight"], conv_pool=conv_pool, slots=c["slots"], context_lens=c["context_lens"],
        groups=3, zero_pool=state_pool,
    ).reshape(3, B, H, K)  # fmt: skip
    o = kda_decode_in_place(
        q, k, v, c["f"].reshape(B, H, K), c["b"], A_log=c["A_log"], dt_bias=c["dt_bias"],
        lower_bound=c["lower_bound"], scale=c["scale"], state_pool=state_pool, slots=c["slots"],
        context_lens=c["context_lens"], fresh_zeroed=True,
    )  # fmt: skip
    y = gated_rms_norm(o, c["gate"].reshape(B, H, K), c["norm_weight"], c["eps"], torch.bfloat16)
    return y.reshape(B, H * K)


def _variant(text: str) -> str:
    """A --variants entry checked by K3RUN_KDA_FUSED_FORM's parser (the layer's spelling of a launch)."""
    try:
        return Knobs.from_env({"K3RUN_KDA_FUSED_FORM": text}).kda_fused_form
    except ValueError as e:
        raise SystemExit(f"--variants: {e}") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--heads", default="32,96", help="local KDA heads (Kimi Linear 32, K3 96)")
    ap.add_argument(
        "--variants",
        default="",
        help="fused kernels' BV/warps[/flat] to time beside, e.g. 64/4,32/4/flat",
    )
    args = ap.parse_args()
    variants = [_variant(v) for v in args.variants.split(",") if v]
    tbs = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {tbs:.2f} TB/s, head dim {K}")
    print(
        f"{'H':>3} {'B':>3} {'chain us':>9} {'fused us':>9} {'speed-up':>8} {'ceiling us':>10} "
        f"{'of ceiling':>10} {'rel RMS':>8}" + "".join(f" {v + ' us':>12}" for v in variants)
    )
    for H in [int(v) for v in args.heads.split(",")]:
        for B in [int(v) for v in args.batches.split(",")]:
            state_bytes = B * H * K * K * 4
            n = copies_for(state_bytes)
            c, convs, states = _inputs(B, H, n, None if H == 32 else -5.0)
            # same pools, same starting values: the outputs of one call of each
            conv0, state0 = convs[0].clone(), states[0].clone()  # the timed calls below advance the pools
            want = _chain(c, conv0.clone(), state0.clone())
            got = kda_decode_fused_triton(**c, conv_pool=conv0.clone(), state_pool=state0.clone())
            err = rel_rms_error(want.float(), got.float())
            chain = [partial(_chain, c, convs[i], states[i]) for i in range(n)]
            fused = [
                partial(kda_decode_fused_triton, **c, conv_pool=cp, state_pool=sp)
                for cp, sp in zip(convs, states, strict=True)
            ]
            t_c, t_f = graph_ms(chain) * 1e3, graph_ms(fused) * 1e3
            ceil = 2 * state_bytes / (tbs * 1e12) * 1e6
            extra = ""
            for form in variants:
                kw = fused_form_kwargs(form)
                other = kda_decode_fused_triton(**c, conv_pool=conv0.clone(), state_pool=state0.clone(), **kw)
                if rel_rms_error(got.float(), other.float()) > 1e-2:  # a bf16 output: a few roundings
                    raise SystemExit(f"{form} differs from the default launch at H {H}, B {B}")
                calls = [
                    partial(kda_decode_fused_triton, **c, conv_pool=cp, state_pool=sp, **kw)
                    for cp, sp in zip(convs, states, strict=True)
                ]
                extra += f" {graph_ms(calls) * 1e3:>12.1f}"
            print(
                f"{H:>3} {B:>3} {t_c:>9.1f} {t_f:>9.1f} {t_c / t_f:>7.2f}x {ceil:>10.2f} {ceil / t_f:>10.1%} "
                f"{err:>8.1e}" + extra
            )


if __name__ == "__main__":
    main()
