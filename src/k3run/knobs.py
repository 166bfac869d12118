"""k3run's own environment variables (`K3RUN_*`), parsed in one place.

`knobs()` reads them all from os.environ at its first call and returns the same frozen `Knobs` after that;
a malformed value of any of them is a ValueError naming the variable, the values it takes and the value
found (the CLI prints it as one line and exits with code 2). An empty value is the same as an unset one.
The table of variables, with their effects, is docs/knobs.md.

Variables that are not k3run's own are read where they are used: torchrun's WORLD_SIZE / RANK / LOCAL_RANK
(distributed.py), OMP_NUM_THREADS (cpu_threads.py), TRITON_INTERPRET (kernels/moe_ops/triton.py).

Tests and benchmarks that change a variable call `reset_knobs()` after the change (the next `knobs()` parses
the environment again), or run a block under `override_knobs(field=value)` without touching the environment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

# Each parser takes (variable, value) for a set, non-empty value; its docstring is the values it takes.


# the launch-saving decode knobs below help small steps and lose at 32 tokens (bench/NOTES.md)
_SMALL_STEPS = "on by default up to 8, where the full-depth decode is faster with it"


def _malformed(name: str, expected: str, value: str) -> ValueError:
    return ValueError(f"{name}: expected {expected}, got {value!r}")


def _flag(name: str, value: str) -> bool:
    """0 or 1"""
    if value not in ("0", "1"):
        raise _malformed(name, "0 or 1", value)
    return value == "1"


def _positive_int(name: str, value: str) -> int:
    """a positive integer"""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise _malformed(name, "a positive integer", value)
    return n


def _cpu_simd(name: str, value: str) -> str:
    """avx2, 0 or off"""
    if value in ("0", "off"):
        return "off"
    if value != "avx2":
        raise _malformed(name, "avx2, 0 or off", value)
    return value


def _sm90_producer(name: str, value: str) -> str:
    """auto, thread, warp or tensor"""
    if value not in ("auto", "thread", "warp", "tensor"):
        raise _malformed(name, "auto, thread, warp or tensor", value)
    return value


def _moe_groups(name: str, value: str) -> str:
    """atomic or passes"""
    if value not in ("atomic", "passes"):
        raise _malformed(name, "atomic or passes", value)
    return value


def _by_expert_tile(name: str, value: str) -> int:
    """8, 16 or 32"""
    if value not in ("8", "16", "32"):
        raise _malformed(name, "8, 16 or 32", value)
    return int(value)


def _split_k(name: str, value: str) -> int:
    """0 to 8"""
    if value not in tuple("012345678"):
        raise _malformed(name, "a split from 0 to 8", value)
    return int(value)


def _tokens_up_to(most: int, what: str = "token count") -> Callable[[str, str], int]:
    """The parser of a count (`what`) from 0 to `most`."""

    def parse(name: str, value: str) -> int:
        if not value.isdigit() or not 0 <= int(value) <= most:
            raise _malformed(name, f"a {what} from 0 to {most}", value)
        return int(value)

    parse.__doc__ = f"0 to {most}"
    return parse


def _t32_form(name: str, value: str) -> str:
    """R/T (R, T in 1, 2, 4; R * T <= 8)"""
    parts = value.split("/")
    ok = len(parts) == 2 and parts[0] in ("1", "2", "4") and parts[1] in ("1", "2", "4")
    if not ok or int(parts[0]) * int(parts[1]) > 8:
        raise _malformed(name, "R/T (R, T in 1, 2, 4; R * T <= 8)", value)
    return value


_tokens_16 = _tokens_up_to(16)
_tokens_128 = _tokens_up_to(128)
_tokens_256 = _tokens_up_to(256)


def _kda_fused_form(name: str, value: str) -> str:
    """BV/warps[/flat][/pN] (BV 8 to 128, a power of two; warps 1, 2, 4 or 8; pN: N = 1..8 persistent
    programs an SM)"""
    parts = value.split("/")
    tail = parts[2:]
    persist = tail[-1] if tail and tail[-1][:1] == "p" else None
    rest = tail[:-1] if persist else tail
    ok = len(parts) >= 2 and all(p.isdigit() for p in parts[:2]) and rest in ([], ["flat"])
    ok = ok and persist in (None, "p1", "p2", "p3", "p4", "p5", "p6", "p7", "p8")
    if not ok or parts[0] not in ("8", "16", "32", "64", "128") or parts[1] not in ("1", "2", "4", "8"):
        expected = (
            "BV/warps, BV/warps/flat, optionally /pN after them; BV 8 to 128 a power of two, warps 1, 2, 4 "
            "or 8, N 1 to 8"
        )
        raise _malformed(name, expected, value)
    return value


def _moe_stream(name: str, value: str) -> str:
    """R/S (R 1 to 32 programs an SM, S 2 to 8 ring slots) or 0"""
    if value == "0":
        return value
    parts = value.split("/")
    ok = len(parts) == 2 and all(p.isdigit() for p in parts)
    if not ok or not 1 <= int(parts[0]) <= 32 or not 2 <= int(parts[1]) <= 8:
        raise _malformed(name, "R/S with R 1 to 32 programs an SM and S 2 to 8 ring slots, or 0", value)
    return value


def _dist_backend(name: str, value: str) -> str:
    """nccl or gloo"""
    if value not in ("nccl", "gloo"):
        raise _malformed(name, "'nccl' or 'gloo'", value)
    return value


def _text(name: str, value: str) -> str:
    """text"""
    return value


def _knob(var: str, parse: Callable[[str, str], Any], default: Any, meaning: str, **kw: Any) -> Any:
    """A Knobs field read from $var by parse(var, value) when set and not empty, else `default`."""
    return field(default=default, metadata={"var": var, "parse": parse, "meaning": meaning}, **kw)


@dataclass(frozen=True)
class Knobs:
    """One field per `K3RUN_*` variable: its parsed value (the default where the variable is unset)."""

    cpu_threads: int | None = _knob(
        "K3RUN_CPU_THREADS", _positive_int, None,
        "CPU intra-op threads; over OMP_NUM_THREADS and the choice by the largest matrix, under `--threads`",
    )  # fmt: skip
    cpu_simd: str = _knob(
        "K3RUN_CPU_SIMD", _cpu_simd, "auto",
        "the CPU C++ extension: auto (AVX-512 or AVX2, as the CPU has), avx2 (AVX2 on an AVX-512 CPU), off",
    )  # fmt: skip
    cpu_int8: bool = _knob(
        "K3RUN_CPU_INT8", _flag, False,
        "NVFP4 linears and experts on the CPU on int8-rounded activations (AVX-512 VNNI CPUs)",
    )  # fmt: skip
    fp8_gemv: bool = _knob(
        "K3RUN_FP8_GEMV", _flag, True,
        "CUDA sm_89+: FP8_PB_WO calls of up to FP8_GEMV_MAX_M rows on the split-K decode GEMV",
    )  # fmt: skip
    mla_decode_kernel: bool = _knob(
        "K3RUN_MLA_DECODE_KERNEL", _flag, True,
        "CUDA: static MLA decode attention on the Triton kernel (0: the fp32 reference)",
    )  # fmt: skip
    mla_shared_splits: bool | None = _knob(
        "K3RUN_MLA_SHARED_SPLITS", _flag, None,
        "CUDA: 1: the MLA decode kernel's splits always shared among a step's sequences by their lengths "
        "(each takes pieces out of ~2 programs an SM, found on the device); 0: always a fixed grid per "
        "sequence; unset: shared from 32 (sequence, 32-head block) pairs, or 8 at windows of >= 32K "
        "positions (`kernels/mla/triton.py: shares_splits`)",
    )  # fmt: skip
    mla_absorb_kernels: int = _knob(
        "K3RUN_MLA_ABSORB_KERNELS", _tokens_128, 64,
        "CUDA: static MLA decode steps of up to this many sequences run the latent (norm, join, cache "
        "store), query absorption (q_nope . W_UK, joined with the RoPE part) and output projection (. W_UV, "
        "rounded to the activation dtype) as one Triton launch each, where torch's take 9-10 (0: torch "
        "always); from 9 sequences the absorptions run on the tensor cores; on by default up to 64, where "
        "the full-depth decode is faster with them (+1-4.5% at 16-32 sequences)",
    )  # fmt: skip
    mla_absorb_fma: int = _knob(
        "K3RUN_MLA_ABSORB_FMA", _tokens_128, 0,
        "CUDA: MLA decode steps of up to this many sequences run both absorptions as one fp32 FMA dot a "
        "program (exact products, fp32 sums in another order) instead of one sequence at a time or the "
        "tensor cores' nine-part dots (0: never; 2-8x slower than those forms alone on an H100, so off)",
    )  # fmt: skip
    moe_ops: bool = _knob(
        "K3RUN_MOE_OPS", _flag, True,
        "CUDA: the MoE's router, activation and combine as single Triton launches (0: torch's chains)",
    )  # fmt: skip
    moe_router_one_launch: bool = _knob(
        "K3RUN_MOE_ROUTER_ONE_LAUNCH", _flag, False,
        "CUDA: the MoE router's logits and top-k in one launch where its partial logits are <= 64 KB (Kimi "
        "Linear up to 4 tokens; 1: on; 0: two launches); measured no faster than two",
    )  # fmt: skip
    moe_router_partials: int = _knob(
        "K3RUN_MOE_ROUTER_PARTIALS", _tokens_256, 16,
        "CUDA: up to this many tokens the router's logits run on the partials kernel (broadcast products, x "
        "loaded a token block ahead), above it cuBLAS's fp32 GEMM",
    )  # fmt: skip
    moe_router_dot: int = _knob(
        "K3RUN_MOE_ROUTER_DOT", _tokens_256, 64,
        "CUDA: from 5 up to this many tokens of bf16 activations the router's partial logits run on the "
        "tensor cores, 16-token blocks times the fp32 weight split exactly into three bf16 parts, instead "
        "of the broadcast kernel or cuBLAS (0: off); the full-depth Kimi Linear step +1.3% / +1.8% / +2.1% "
        "at batch 8 / 16 / 32 with 64 (H100), batch 1 unchanged",
    )  # fmt: skip
    moe_combine_in_norm: int = _knob(
        "K3RUN_MOE_COMBINE_IN_NORM", _tokens_128, 8,
        "CUDA: up to this many tokens an MoE layer's top-k sum on the grouped launches runs inside the next "
        "RMSNorm's launch (0: always its own launch); " + _SMALL_STEPS,
    )  # fmt: skip
    moe_act_in_gemm1: int = _knob(
        "K3RUN_MOE_ACT_IN_GEMM1", _tokens_128, 8,
        "CUDA: up to this many tokens NVFP4 routed experts' decode GEMM1 applies the gated activation in its "
        "epilogue, one launch fewer a MoE layer (0: always its own launch); " + _SMALL_STEPS,
    )  # fmt: skip
    moe_by_expert: bool = _knob(
        "K3RUN_MOE_BY_EXPERT", _flag, True,
        "CUDA: NVFP4 routed experts at 2..128 tokens in the expert-major launches (0: per-pick launches)",
    )  # fmt: skip
    moe_gemm2_early: bool = _knob(
        "K3RUN_MOE_GEMM2_EARLY", _flag, False,
        "CUDA: the NVFP4 routed experts' GEMM2 decode launch reads its group table and stages its first "
        "weights before its PDL wait (the table predates GEMM1; 0: it waits first, as GEMM1 does); within "
        "the spread of the full-depth step (H100), so off",
    )  # fmt: skip
    moe_stream: str = _knob(
        "K3RUN_MOE_STREAM", _moe_stream, "0",
        "CUDA: the NVFP4 routed experts' expert-major decode launches as stream-K (kernels/nvfp4_gemm/"
        "expert_stream.py): R programs an SM sharing the launch's K tiles evenly, each with a ring of S "
        "weight slots; R is cut to the programs an SM holds (28 / 21 / 14 for token tiles 8 / 16 / 32) "
        "(0: one program per (group, 16-row block)); not yet timed, so off",
    )  # fmt: skip
    moe_groups: str = _knob(
        "K3RUN_MOE_GROUPS", _moe_groups, "atomic",
        "CUDA: how the expert-major decode launches' group table is built (kernels/nvfp4_gemm/groups.py): "
        "atomic (one atomic round for up to 1024 picks; the full-depth decode ~3% faster at batch 8 "
        "and 32) or passes (64-pick chunks, each group's picks in order)",
    )  # fmt: skip
    moe_fuse_shared: int = _knob(
        "K3RUN_MOE_FUSE_SHARED", _tokens_128, 4,
        "CUDA: up to this many tokens an NVFP4 MoE's shared expert runs as one more expert of the routed "
        "experts' grouped decode launches (0: never, its own linears on a side stream; set up at load). 4: "
        "full-depth Kimi Linear decodes ~0.6% faster fused at batch 4 and ~1% faster apart at 5-8 (H100)",
    )  # fmt: skip
    moe_by_expert_tile: int | None = _knob(
        "K3RUN_MOE_BY_EXPERT_TILE", _by_expert_tile, None,
        "the expert-major launches' token tile, 8, 16 or 32 (unset: 8 up to 8 tokens or 4 expected picks "
        "an expert, else 16)",
    )  # fmt: skip
    moe_expert_split: int = _knob(
        "K3RUN_MOE_EXPERT_SPLIT", _split_k, 1,
        "CUDA: split_k of the NVFP4 routed experts' expert-major decode launches (2..128 tokens), 1..8, "
        "rounded down to a divisor of the 128-wide chunk count (0: sized to fill the GPU's waves, "
        "one_wave_split, as the one-token launches are)",
    )  # fmt: skip
    dequant_chunks: int = _knob(
        "K3RUN_DEQUANT_CHUNKS", _tokens_up_to(16, "chunk count"), 0,
        "CUDA: NVFP4 linears on dequantize + cuBLAS (above the GEMM kernels' rows) dequantize their weight "
        "in this many row chunks on a second stream while cuBLAS multiplies the previous chunk "
        "(kernels/nvfp4_gemm/dequant_mm.py; 0 or 1: the whole weight, then one product; off: on an H100 at "
        "4096 rows 2-8 chunks were slower than one on two of three K3 shapes)",
    )  # fmt: skip
    wgmma_x_gather: int = _knob(
        "K3RUN_WGMMA_X_GATHER", _tokens_256, 32,
        "CUDA sm_90: up to this many rows the dense NVFP4 wgmma GEMM copies x in its operand order itself "
        "and launches with PDL, instead of a torch copy reordering x before each call, where its programs' "
        "copies read at most 20 MiB (wgmma.GATHER_MAX_BYTES; 0: never)",
    )  # fmt: skip
    sm90_cuda: bool = _knob(
        "K3RUN_SM90_CUDA", _flag, True,
        "CUDA sm_90: NVFP4 linears of 17..1024 rows, >= 32M weights, on the CUDA C++ GEMM (0: the Gluon one "
        "to 256 rows, dequantize + cuBLAS above)",
    )  # fmt: skip
    gemv_t32_form: str = _knob(
        "K3RUN_GEMV_T32_FORM", _t32_form, "1/2",
        "CUDA: the program of the dense NVFP4 decode launches of 17..32 rows, R/T: R row warps of 16 weight "
        "rows each, T token warps splitting the 32 token columns, each decoding the same rows (1/1: one warp "
        "holds every column)",
    )  # fmt: skip
    sm90_gemv: int = _knob(
        "K3RUN_SM90_GEMV", _tokens_16, 0,
        "CUDA sm_90: dense NVFP4 linears of up to this many rows (at most 16; K a multiple of 128) on the "
        "CUDA C++ decode GEMV (mma.sync on operands loaded straight into registers) instead of the Gluon "
        "one (0: never; on an H100 it ran 0.82-1.07x the Gluon kernel on K3's matrices and 0.48-0.86x on "
        "Kimi Linear's, so it is off)",
    )  # fmt: skip
    sm90_gemv_experts: bool = _knob(
        "K3RUN_SM90_GEMV_EXPERTS", _flag, False,
        "CUDA sm_90: NVFP4 routed experts' decode launches (per pick and expert-major, token tiles of 8 and "
        "16, K a multiple of 128) on the CUDA C++ decode GEMV instead of the Gluon one (off: as dense "
        "matrices Kimi Linear's expert shapes ran 0.6-0.86x the Gluon kernel on an H100)",
    )  # fmt: skip
    sm90_stream_k: int = _knob(
        "K3RUN_SM90_STREAM_K", _tokens_256, 0,
        "CUDA sm_90: the CUDA C++ NVFP4 GEMM runs stream-K (every CTA slot of one wave walks an equal share "
        "of the tiles' K chunks) up to this many rows, where its fixed split_k grid would leave slots idle "
        "(0, the default: never; on an H100 it beat the thread producer's fixed grid 1.01-1.25x at 16-32 "
        "rows, but the tensor producer's fixed grid matches or beats it: 0.98-1.10x at 16-32 rows)",
    )  # fmt: skip
    sm90_tail_split: bool = _knob(
        "K3RUN_SM90_TAIL_SPLIT", _flag, True,
        "CUDA sm_90: where the CUDA C++ NVFP4 GEMM's two-warpgroup grid has a last wave at most half full, "
        "its tiles in two pieces each and the full waves' tiles whole (w4a16_sm90.tail_split; 1, the "
        "default; on an H100 1.07-1.09x the fixed grid at 12288 x 7168 / 256 rows, 0.99-1.03x at 448 "
        "tiles; 0: the fixed grid)",
    )  # fmt: skip
    sm90_three_wg: bool = _knob(
        "K3RUN_SM90_THREE_WG", _flag, True,
        "CUDA sm_90: above 128 rows, three consumer warpgroups a CTA (192 weight rows, each warpgroup "
        "decoding into one A set) where their waves take no longer than two warpgroups' "
        "(w4a16_sm90.three_wg_pays; 1, the default; on an H100 12288 x 7168 at 256 rows 70.2 us against the "
        "tail split's 89.6, 1.28x; 0: two warpgroups, with the tail split)",
    )  # fmt: skip
    sm90_x_gather: int = _knob(
        "K3RUN_SM90_X_GATHER", _tokens_256, 0,
        "CUDA sm_90: up to this many rows the CUDA C++ NVFP4 GEMM copies x [M, K] itself by tensor map and "
        "its consumers permute each slot into the operand's order, without the x preparation launch (fixed "
        "grid, one consumer warpgroup, BT <= 32, the warp or tensor producer; 0, the default: never; on an "
        "H100 it ran 1.15-1.4x slower than preparing x at 16-32 rows: the permute sits on the consumers' "
        "critical path)",
    )  # fmt: skip
    sm90_producer: str = _knob(
        "K3RUN_SM90_PRODUCER", _sm90_producer, "auto",
        "CUDA sm_90: how the CUDA C++ NVFP4 GEMM's producer feeds its ring: thread (one thread issues the 9 "
        "bulk copies a chunk), warp (the whole warp walks the ring, one elected lane issues them), tensor "
        "(that, with one tensor-map copy for the chunk's codes and one for its scales), auto (tensor on the "
        "fixed grid, H100: 1.02-1.10x thread at 16-64 rows with one consumer warpgroup; thread for "
        "stream-K, where tensor measured 0.95-0.89x at 16 rows)",
    )  # fmt: skip
    sm90_pdl: bool = _knob(
        "K3RUN_SM90_PDL", _flag, True,
        "CUDA sm_90: the CUDA C++ NVFP4 GEMM's two launches (x preparation, the GEMM) with programmatic "
        "dependent launch where a CTA's ring fills more than half an SM's shared memory (w4a16_sm90."
        "pdl_helps; H100: 1.06-1.09x plain there, 0.79-0.98x at configs that leave room for a second CTA): "
        "the GEMM copies its first weight chunks while the kernel before it finishes (0: plain launches)",
    )  # fmt: skip
    pdl_all: bool = _knob(
        "K3RUN_PDL_ALL", _flag, True,
        "CUDA sm_90+: the decode step's small Triton kernels (norms, router, activation, combine, KDA conv, "
        "expert grouping, MLA decode attention) launched with programmatic dependent launch, as the NVFP4 "
        "GEMVs are (0: plain launches)",
    )  # fmt: skip
    side_stream: bool = _knob(
        "K3RUN_SIDE_STREAM", _flag, True,
        "CUDA: a layer's independent branch (the shared experts, KDA's low-rank output gate, MLA's query) on "
        "a second stream up to K3RUN_SIDE_MAX_TOKENS rows (0: inline)",
    )  # fmt: skip
    side_max_tokens: int = _knob(
        "K3RUN_SIDE_MAX_TOKENS", _tokens_256, 32,
        "CUDA: rows up to which a layer's branch runs on the side stream (layers/branch.py's "
        "side_stream_applies says why 32)",
    )  # fmt: skip
    kda_fb_side: bool = _knob(
        "K3RUN_KDA_FB_SIDE", _flag, False,
        "CUDA: KDA's forget-gate up-projection (f_b) as a side-stream branch beside the conv, joined before "
        "the recurrence (1: on; 0: in the chain)",
    )  # fmt: skip
    kda_fused_decode: int = _knob(
        "K3RUN_KDA_FUSED_DECODE", _tokens_256, 32,
        "CUDA: KDA decode steps of up to this many sequences run the conv, the gates, the q/k norm, the "
        "recurrent step and the gated output norm as one Triton launch (kernels/kda/decode.py), where the "
        "chain is three launches, reading its recurrent state before its PDL wait (0: never; on by default "
        "up to 32, the range where the full-depth decode was measured faster with it)",
    )  # fmt: skip
    kda_fused_form: str | None = _knob(
        "K3RUN_KDA_FUSED_FORM", _kda_fused_form, None,
        "the fused KDA decode's launch: value columns a program / warps a program, with /flat its conv "
        "windows shifted as flat runs (fewer registers; 3% faster alone at 32 sequences, H100), without "
        "it as a [channels, W - 1] block; with /pN, N persistent programs an SM, each loading its next "
        "item's state while working on one (1.4-1.6x slower alone at 8 and 32 sequences, H100) "
        "(unset: 64/4/flat from 1024 (sequence, head) pairs a GPU, else 32/4/flat)",
    )  # fmt: skip
    dist_backend: str | None = _knob(
        "K3RUN_DIST_BACKEND", _dist_backend, None,
        "torch.distributed backend under torchrun, nccl or gloo (unset: NCCL with CUDA, else gloo)",
    )  # fmt: skip
    api_key: str | None = _knob(
        "K3RUN_API_KEY", _text, None,
        "`k3run serve`: the bearer key /v1 requires when --api-key is not given (unset: open)",
        repr=False,
    )  # fmt: skip

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Knobs:
        values = {}
        for f in dataclasses.fields(cls):
            raw = env.get(f.metadata["var"], "")
            if raw:
                values[f.name] = f.metadata["parse"](f.metadata["var"], raw)
        return cls(**values)


# A module global rather than functools.cache: torch.compile traces through knobs() in the compiled CPU
# decode step, and Dynamo ignores an lru_cache wrapper (it would parse the environment inside the trace);
# a global it reads as a guarded constant.
_parsed: Knobs | None = None
_overrides: list[Knobs] = []


def knobs() -> Knobs:
    """The parsed `K3RUN_*` variables (parsed at the first call; see the module docstring)."""
    global _parsed
    if _overrides:
        return _overrides[-1]
    if _parsed is None:
        _parsed = Knobs.from_env(os.environ)
    return _parsed


def reset_knobs() -> None:
    """Forget the parsed variables: the next `knobs()` reads the environment again."""
    global _parsed
    _parsed = None


@contextlib.contextmanager
def override_knobs(**changes: Any) -> Iterator[Knobs]:
    """Inside the block `knobs()` returns the current knobs with `changes` (field names, parsed values)."""
    k = dataclasses.replace(knobs(), **changes)
    _overrides.append(k)
    try:
        yield k
    finally:
        _overrides.pop()


def table() -> list[str]:
    """The rows of docs/knobs.md's table, one per field: variable, field, type, values, default, effect
    (a test keeps the document equal to them)."""
    rows = []
    for f in dataclasses.fields(Knobs):
        default = (
            "unset" if f.default is None else int(f.default) if isinstance(f.default, bool) else f.default
        )
        cells = [
            f"`{f.metadata['var']}`",
            f"`{f.name}`",
            f"`{str(f.type).removesuffix(' | None')}`",
            f.metadata["parse"].__doc__,
        ]
        rows.append("| " + " | ".join([*cells, f"{default}", f.metadata["meaning"]]) + " |")
    return rows
