"""The `k3run` command line: generate, inspect, quantize, eval, bench, serve, run-default.

Under torchrun (WORLD_SIZE > 1) generate, bench and serve load the model tensor-parallel over the world (NCCL
on GPUs, gloo on CPU or with K3RUN_DIST_BACKEND=gloo); every rank runs the engine, rank 0 prints / serves."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from k3run.knobs import knobs

if TYPE_CHECKING:
    import torch

    from k3run.engine import LLM

# The bundled default model (trained by scripts/train_default_model.py, quantized with the k3-mixed recipe)
# lives under assets/ in the repository, found relative to this file so `k3run generate` works from any
# working directory.
REPO_ROOT = Path(__file__).resolve().parents[2]
ASSETS_DIR = REPO_ROOT / "assets"
DEFAULT_PROMPT = "def fibonacci(n):\n"
RECIPES = ("nvfp4", "fp8_pb_wo", "k3-mixed")


class UserError(Exception):
    """A mistake in what the user asked for: reported as one line on stderr, exit code 2."""


class _Parser(argparse.ArgumentParser):
    # argparse prints the whole usage block before its message; one line says the same thing
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _model_dir(path: str | None) -> Path:
    if path is None:
        found = default_model_dir()
        if found is None:
            raise UserError(
                f"no MODEL given and no bundled model under {ASSETS_DIR}; pass a checkpoint directory"
            )
        return found
    return _checkpoint_dir(path, "MODEL")


def default_model_dir() -> Path | None:
    """The bundled checkpoint: among the directories under assets/ with a config.json, a ModelOpt-quantized
    one (MIXED_PRECISION, i.e. k3-mixed, first), else any; None when there is none."""
    if not ASSETS_DIR.is_dir():
        return None
    dirs = sorted(p.parent for p in ASSETS_DIR.glob("*/config.json"))

    def rank(d: Path) -> int:
        qfile = d / "hf_quant_config.json"
        if not qfile.is_file():
            return 2
        return 0 if "MIXED_PRECISION" in qfile.read_text(encoding="utf-8") else 1

    return min(dirs, key=rank) if dirs else None


def _checkpoint_dir(path: str, what: str) -> Path:
    d = Path(path)
    if not d.exists():
        raise UserError(f"{what} {path}: no such directory")
    if not d.is_dir():
        raise UserError(f"{what} {path}: not a directory")
    if not (d / "config.json").is_file():
        raise UserError(f"{what} {path}: no config.json, so not a Hugging Face checkpoint directory")
    return d


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name}: CUDA is not available on this machine")
    return name


def _dtype(name: str | None) -> torch.dtype | None:
    import torch

    return (
        None if name is None else {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]
    )


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _int_list(text: str) -> list[int]:
    return [_positive_int(t) for t in text.split(",") if t]


def _check_kimi(model_dir: Path) -> None:
    """Fail early, with the config's own message, on a checkpoint that is not a Kimi model."""
    from k3run.config import ModelConfig

    try:
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{model_dir / 'config.json'}: not valid JSON ({e})") from e
    try:
        ModelConfig.from_hf(cfg)
    except ValueError as e:
        raise UserError(f"{model_dir}: {e}") from e


def _load_llm(
    args: argparse.Namespace,
    model_dir: Path,
    max_num_seqs: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    serving: bool = False,
) -> LLM:
    """The engine for a command. `serving` (k3run serve): on the CPU, a model of small matrices gets
    compiled decode steps unless --eager (see _compile_small_model)."""
    from k3run.distributed import init_distributed
    from k3run.engine import LLM, EngineConfig

    _check_kimi(model_dir)
    tp = init_distributed()  # under torchrun (WORLD_SIZE > 1): tensor parallel over the world; else a no-op
    cfg = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=max(max_num_batched_tokens, max_num_seqs),
        cache_bytes=args.cache_mib << 20 if args.cache_mib else None,
        tp_size=tp.size,
        cuda_graphs=not getattr(args, "eager", False),
        compile_cpu_decode=getattr(args, "compile", False),
        compile_cpu_cpp_wrapper=getattr(args, "compile_cpp_wrapper", False),
        graph_step_bytes=args.graph_step_mib << 20,
        overlap_decode=False if getattr(args, "no_overlap", False) else None,
        prefix_cache_bytes=getattr(args, "prefix_cache_mib", 0) << 20,
    )
    from k3run.api import load_model
    from k3run.tokenizer import load_tokenizer

    model = load_model(
        model_dir,
        dtype=_dtype(args.dtype),
        device=_device(args.device),
        tp_rank=tp.rank,
        tp_size=tp.size,
        nvfp4_as_fp8=args.nvfp4_as_fp8,
    )
    _cpu_threads(args, model)
    if serving and _compile_small_model(args, model, tp.size):
        cfg = dataclasses.replace(cfg, compile_cpu_decode=True)
    return LLM.from_model(model, load_tokenizer(model_dir), cfg)


def _compile_small_model(args: argparse.Namespace, model: torch.nn.Module, tp_size: int) -> bool:
    """Whether a server compiles its CPU decode steps without being asked: a model whose largest matrix is
    under cpu_fused.MIN_WEIGHTS decodes at the speed of per-op dispatch (the bundled models ~8x slower
    eager than compiled), and a server pays the compile once at start (~40-60 s a
    path on 2 cores the first time, from Inductor's disk cache after). Larger models keep their eager
    steps: those run the SIMD extension's kernels, which a compiled step cannot call."""
    from k3run.cpu_threads import largest_matrix
    from k3run.kernels.cpu_fused import MIN_WEIGHTS

    if args.eager or args.compile or args.compile_cpp_wrapper or tp_size != 1:
        return False
    if next(model.parameters()).device.type != "cpu":
        return False
    name, n = largest_matrix(model)
    if n >= MIN_WEIGHTS:
        return False
    logging.getLogger("k3run.cli").info(
        "CPU decode steps compiled (largest matrix %s has %s weights < %s: eager steps would be per-op "
        "dispatch); compiling before serving, --eager skips it",
        name,
        f"{n:,}",
        f"{MIN_WEIGHTS:,}",
    )
    return True


def _cpu_threads(args: argparse.Namespace, model: torch.nn.Module) -> None:
    """On the CPU, the intra-op threads chosen by the model's work (k3run.cpu_threads), logged once."""
    if next(model.parameters()).device.type != "cpu":
        return
    from k3run.cpu_threads import set_cpu_threads

    logging.getLogger("k3run.cli").info(set_cpu_threads(model, getattr(args, "threads", None)))


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def cmd_generate(args: argparse.Namespace) -> int:
    from k3run.engine import SamplingParams

    model_dir = _model_dir(args.model)
    # checked before the (slow) model load so a bad flag fails at once
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    llm = _load_llm(args, model_dir, 1, args.max_model_len, args.max_model_len)
    prompt: str | list[int] = args.prompt
    if args.chat:
        from k3run import chat_xtml

        turn = [{"role": "user", "content": args.prompt}]
        if chat_xtml.is_xtml(llm.tokenizer):  # K3's format: no template; thinking off, the response streams
            prompt = chat_xtml.encode(llm.tokenizer, chat_xtml.render(turn, thinking=False))
            end = llm.tokenizer.token_to_id(chat_xtml.END_OF_MSG)
            params = dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, end))
        else:  # the template writes its own special tokens (BOS included): none are added when encoding
            text = llm.tokenizer.apply_chat_template(turn)
            prompt = llm.tokenizer.encode(text, add_special_tokens=False)
    n_prompt = len(prompt) if isinstance(prompt, list) else len(llm.tokenizer.encode(prompt))
    if n_prompt + args.max_tokens > args.max_model_len:
        raise UserError(
            f"--max-tokens {args.max_tokens} with a {n_prompt}-token prompt is over --max-model-len "
            f"{args.max_model_len}: raise --max-model-len or lower --max-tokens"
        )
    # compiled (CPU) or captured (CUDA) decode steps are made before the clock starts
    llm.engine.runner.warm_up_graphs(1, n_prompt + args.max_tokens, n_prompt)
    # under tensor parallelism every rank runs the engine; rank 0 alone writes
    out = sys.stdout if _rank() == 0 else open(os.devnull, "w")  # noqa: SIM115
    if not args.chat:
        out.write(args.prompt)
    t0 = time.perf_counter()
    t_first = None
    n = 0
    last = None
    for last in llm.stream(prompt, params):
        if t_first is None:
            t_first = time.perf_counter()
        n = len(last.token_ids)
        out.write(last.delta)
        out.flush()
    t1 = time.perf_counter()
    out.write("\n")
    assert last is not None and t_first is not None
    decode_s = t1 - t_first
    decode_rate = f"{(n - 1) / decode_s:.1f} tokens/s" if n > 1 and decode_s > 0 else "n/a"
    if _rank() != 0:
        return 0
    print(
        f"[k3run] {n} tokens in {t1 - t0:.2f} s ({n / (t1 - t0):.1f} tokens/s; prompt "
        f"{len(last.prompt_token_ids)} tokens, first token after {t_first - t0:.2f} s, decode {decode_rate}; "
        f"finish: {last.finish_reason.value if last.finish_reason else '?'})",
        file=sys.stderr,
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise UserError(f"k3run serve needs the serve extra (pip install 'k3run[serve]'): {e}") from e
    model_dir = _model_dir(args.model)
    llm = _load_llm(
        args, model_dir, args.max_num_seqs, args.max_model_len, args.max_num_batched_tokens, serving=True
    )
    # the shortest window's decode graphs (compiled CPU steps: every path) and every prefill bucket
    llm.engine.runner.warm_up_graphs(args.max_num_seqs, 1, args.max_num_batched_tokens)
    if _rank() != 0:  # tensor parallel: rank 0 serves HTTP, the other ranks mirror its engine
        from k3run.engine.async_engine import follow

        follow(llm.engine)
        return 0
    from k3run.serve import OpenAIServer, build_app

    server = OpenAIServer(
        llm.engine,
        args.served_model_name or model_dir.name,
        max_body_bytes=args.max_body_kib << 10,
        stall_s=args.stall_timeout,
        api_key=args.api_key or knobs().api_key,
        max_concurrent=args.max_concurrent_requests,
    )
    tp = f", tensor parallel over {llm.engine.config.tp_size} ranks" if llm.engine.config.tp_size > 1 else ""
    print(
        f"[k3run] serving {model_dir} as '{server.model_name}' on http://{args.host}:{args.port}/v1 "
        f"(max {args.max_num_seqs} sequences of {args.max_model_len} tokens{tp})",
        file=sys.stderr,
    )
    # SIGTERM / Ctrl-C: stop accepting, let the requests in flight finish for up to --drain-timeout seconds,
    # then cancel the rest (their sequences are aborted) and stop the engine thread
    uvicorn.run(
        build_app(server),
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=args.drain_timeout,
    )
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    d = _checkpoint_dir(args.dir, "DIR")
    from k3run.checks import CheckpointInvalid, validate_checkpoint
    from k3run.quant.plan import build_quant_plan

    # the checks load_model runs (k3run.checks), scale values included unless --headers-only
    problems = validate_checkpoint(d, values=not args.headers_only)
    if problems:
        raise CheckpointInvalid(d, problems)
    plan = build_quant_plan(d, device=_device(args.device), nvfp4_as_fp8=args.nvfp4_as_fp8)
    print(plan.format_table())
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    d = _checkpoint_dir(args.dir, "DIR")
    from k3run.memory_plan import memory_plan

    contexts = [int(c) for c in args.contexts.split(",") if c]
    if not contexts or any(c < 2 for c in contexts):
        raise UserError(f"--contexts {args.contexts!r}: expected comma-separated token counts >= 2")
    plan = memory_plan(d, args.tp, contexts, chunk_tokens=args.chunk_tokens)
    print(plan.format(args.max_num_seqs, args.device_gib))
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    src = _checkpoint_dir(args.src, "SRC")
    dst = Path(args.dst)
    if dst.exists() and any(dst.iterdir()):
        raise UserError(f"DST {dst}: exists and is not empty; choose a new directory")
    from k3run.quant.export import quantize_checkpoint

    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always")
        quantize_checkpoint(src, dst, args.recipe, progress=not args.quiet)
    # the exporter explains each layer it leaves in bf16; a few lines and a count say enough
    for note in notes[:3]:
        print(f"[k3run] note: {note.message}", file=sys.stderr)
    if len(notes) > 3:
        print(f"[k3run] ... and {len(notes) - 3} more notes like these", file=sys.stderr)
    size = sum(p.stat().st_size for p in dst.glob("*.safetensors"))
    secs = time.perf_counter() - t0
    print(f"[k3run] wrote {dst} ({args.recipe}, {size / 2**20:.2f} MiB of tensors) in {secs:.1f} s")
    return 0


def _heldout_text(args: argparse.Namespace, model_dir: Path) -> str:
    if args.text is not None:
        path = Path(args.text)
        if not path.is_file():
            raise UserError(f"--text {args.text}: no such file")
    else:
        # the bundled default model ships held-out text next to it; any other checkpoint needs --text
        candidates = [model_dir / "heldout.txt", model_dir.parent / "heldout.txt"]
        found = [p for p in candidates if p.is_file()]
        if not found:
            raise UserError(f"no --text given and no heldout.txt in {model_dir} or its parent")
        path = found[0]
    return path.read_text(encoding="utf-8")


def cmd_eval(args: argparse.Namespace) -> int:
    from k3run import eval as evaluation
    from k3run.tokenizer import load_tokenizer

    model_dir = _checkpoint_dir(args.dir, "DIR")
    _check_kimi(model_dir)
    ref_dir = _checkpoint_dir(args.reference, "--reference") if args.reference else None
    text = _heldout_text(args, model_dir)
    tok = load_tokenizer(model_dir)
    windows = evaluation.windows(tok.encode(text, add_special_tokens=False), args.window, args.max_tokens)
    if not windows:
        raise UserError("the held-out text encodes to fewer than 2 tokens")
    from k3run.api import load_model

    device, dtype = _device(args.device), _dtype(args.dtype)
    model = load_model(model_dir, dtype=dtype, device=device, nvfp4_as_fp8=args.nvfp4_as_fp8)
    _cpu_threads(args, model)
    ref = load_model(ref_dir, dtype=dtype, device=device) if ref_dir else None
    if ref is not None and ref.config.vocab_size != model.config.vocab_size:
        raise UserError(
            f"--reference vocab_size {ref.config.vocab_size} != {model.config.vocab_size}: not the same model"
        )
    result = evaluation.evaluate(model, windows, device, ref, progress=not args.no_progress)
    print("\n".join(evaluation.report(result, str(model_dir), str(ref_dir), args.window)))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from k3run.bench import report, run_bench

    model_dir = _checkpoint_dir(args.dir, "DIR")
    max_bs = max(args.batch_sizes)
    llm = _load_llm(
        args, model_dir, max_bs, args.prompt_len + args.decode_tokens + 1, max_bs * args.prompt_len
    )
    progress = not args.no_progress and _rank() == 0
    results = run_bench(llm.engine, args.batch_sizes, args.prompt_len, args.decode_tokens, progress)
    if _rank() == 0:
        print("\n".join(report(llm.engine, model_dir, args.prompt_len, args.decode_tokens, results)))
    return 0


def cmd_run_default(args: argparse.Namespace) -> int:
    """`make run`: stream a continuation of a fixed prompt from the bundled model (default sampling)."""
    if default_model_dir() is None:
        raise UserError(f"the bundled model is missing: no checkpoint under {ASSETS_DIR}")
    return cmd_generate(build_parser().parse_args(["generate", "--prompt", DEFAULT_PROMPT]))


def _add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: %(default)s)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None, help="activation dtype")
    p.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="CPU intra-op threads (default: 1 for a model of small matrices, else every core; "
        "$K3RUN_CPU_THREADS also sets it)",
    )


def _add_nvfp4_as_fp8(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nvfp4-as-fp8",
        action="store_true",
        help="convert NVFP4 linears to FP8 128x128 blocks at load and use FP8 tensor cores where measured "
        "faster (sm90; lossy, ~3e-2 relative weight error; off by default)",
    )


def _add_cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache-mib", type=_positive_int, default=None, help="cache budget in MiB (checked at start)"
    )
    p.add_argument(
        "--eager",
        action="store_true",
        help="run decode steps eagerly: on CUDA no captured CUDA graphs; on the CPU no compiled steps "
        "(`serve` compiles a model of small matrices by default)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="on the CPU, run decode steps compiled by torch.compile (the whole step as one C++ graph: "
        "several times faster for small models; ~40-60 s to compile each path (batch 1, small and large "
        "batches) on 2 cores the first time, cached on disk for later runs)",
    )
    p.add_argument(
        "--compile-cpp-wrapper",
        action="store_true",
        help="--compile with Inductor's C++ wrapper: faster decode steps for small models (1.25-1.7x on "
        "the bundled one), ~130 s to compile a step the first time",
    )
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="with graph decode, wait for each step's tokens before launching the next (by default the next "
        "step is launched from the sampled tokens on the GPU while the host records the previous one)",
    )
    p.add_argument(
        "--prefix-cache-mib",
        type=int,
        default=0,
        help="memory for prompt-prefix snapshots (MLA latents + KDA states) that later prompts starting "
        "with the same tokens reuse; 0 (default): no prefix caching",
    )
    p.add_argument(
        "--graph-step-mib",
        type=_positive_int,
        default=1024,
        help="the most temporary memory a captured decode step may hold (its attention window grows with "
        "batch x context); longer-context steps decode eagerly (default: %(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    from k3run import __version__

    parser = _Parser(prog="k3run", description=__doc__)
    parser.add_argument("--version", action="version", version=f"k3run {__version__}")
    # the global flags are accepted before or after the command; SUPPRESS keeps a subcommand's unset flag
    # from overwriting a value given before it
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS, help="full tracebacks")
    common.add_argument(
        "--quiet", action="store_true", default=argparse.SUPPRESS, help="no start-up report (cache, kernels)"
    )
    parser.add_argument("--traceback", action="store_true", help="show the full traceback of an error")
    parser.add_argument("--quiet", action="store_true", help="no start-up report (cache plan, kernels)")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    _add_generate(sub, common)
    _add_serve(sub, common)
    _add_plan(sub, common)
    _add_inspect(sub, common)
    _add_quantize(sub, common)
    _add_eval(sub, common)
    _add_bench(sub, common)
    _add_run_default(sub, common)
    return parser


def _add_generate(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "generate", parents=[common], help="generate text from a prompt, streamed to the terminal"
    )
    p.add_argument(
        "model", nargs="?", metavar="MODEL", help="checkpoint directory (default: the bundled model)"
    )
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=_positive_int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=40, help="0 disables")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-model-len", type=_positive_int, default=1024, help="prompt + generated tokens")
    _add_device_args(p)
    _add_nvfp4_as_fp8(p)
    _add_cache_args(p)
    p.set_defaults(func=cmd_generate)


def _add_serve(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "serve",
        parents=[common],
        help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)",
    )
    p.add_argument(
        "model", nargs="?", metavar="MODEL", help="checkpoint directory (default: the bundled model)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_positive_int, default=8000)
    p.add_argument(
        "--served-model-name", default=None, help="the 'model' clients name (default: the dir name)"
    )
    p.add_argument("--max-num-seqs", type=_positive_int, default=8, help="sequences batched at once")
    p.add_argument("--max-model-len", type=_positive_int, default=2048, help="prompt + generated tokens")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048, help="tokens per step")
    p.add_argument(
        "--max-body-kib", type=_positive_int, default=4096, help="largest request body, KiB (413 above)"
    )
    p.add_argument(
        "--drain-timeout",
        type=_positive_int,
        default=30,
        help="on SIGTERM, seconds to let requests in flight finish before cancelling them (default: 30)",
    )
    p.add_argument(
        "--stall-timeout",
        type=_positive_int,
        default=120,
        help="/health answers 503 when one engine step runs longer than this many seconds (default: 120)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 (default: $K3RUN_API_KEY; none: open). The "
        "environment variable keeps the key out of the process list",
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=_positive_int,
        default=None,
        help="completion requests answered at once; more get 429 (default: no limit)",
    )
    _add_device_args(p)
    _add_nvfp4_as_fp8(p)
    _add_cache_args(p)
    p.set_defaults(func=cmd_serve)


def _add_plan(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "plan", parents=[common], help="per-rank memory under tensor / expert parallelism (config only)"
    )
    p.add_argument(
        "dir", metavar="DIR", help="a checkpoint directory (only config.json and quant configs read)"
    )
    p.add_argument(
        "--tp", type=_positive_int, default=1, help="ranks sharing the model (experts split as EP)"
    )
    p.add_argument("--contexts", default="32768,131072", help="context lengths for the cache (tokens)")
    p.add_argument("--max-num-seqs", type=_positive_int, default=1, help="sequences cached at once")
    p.add_argument(
        "--chunk-tokens", type=_positive_int, default=8192, help="prefill chunk for the temporaries"
    )
    p.add_argument("--device-gib", type=float, default=139.0, help="device memory to check against (H200)")
    p.set_defaults(func=cmd_plan)


def _add_inspect(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "inspect", parents=[common], help="per-layer quantization plan, bytes by scheme, kernels"
    )
    p.add_argument("dir", metavar="DIR")
    p.add_argument(
        "--device", default="auto", help="the device whose kernels to report (default: %(default)s)"
    )
    p.add_argument(
        "--headers-only",
        action="store_true",
        help="skip reading the scale tensors (at 1.6 TB the E4M3 block scales are ~170 GB)",
    )
    _add_nvfp4_as_fp8(p)
    p.set_defaults(func=cmd_inspect)


def _add_quantize(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "quantize", parents=[common], help="write a ModelOpt-format checkpoint from a bf16 one"
    )
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument("--recipe", choices=RECIPES, required=True)
    p.set_defaults(func=cmd_quantize)


def _add_eval(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "eval", parents=[common], help="held-out perplexity; KL and top-1 agreement against a reference"
    )
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--reference", metavar="REF_DIR", help="checkpoint to compare against (e.g. the bf16 one)")
    p.add_argument("--text", metavar="FILE", help="held-out text (default: heldout.txt next to DIR)")
    p.add_argument("--window", type=_positive_int, default=256, help="tokens per evaluated window")
    p.add_argument("--max-tokens", type=_positive_int, default=8192, help="evaluate at most this many tokens")
    p.add_argument("--no-progress", action="store_true")
    _add_device_args(p)
    _add_nvfp4_as_fp8(p)
    p.set_defaults(func=cmd_eval)


def _add_bench(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("bench", parents=[common], help="prefill and decode tokens/s at several batch sizes")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 4, 16], help="comma separated")
    p.add_argument("--prompt-len", type=_positive_int, default=128)
    p.add_argument("--decode-tokens", type=_positive_int, default=32)
    p.add_argument("--no-progress", action="store_true")
    _add_device_args(p)
    _add_nvfp4_as_fp8(p)
    _add_cache_args(p)
    p.set_defaults(func=cmd_bench)


def _add_run_default(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "run-default", parents=[common], help="generate with the bundled default model (what `make run` does)"
    )
    p.set_defaults(func=cmd_run_default)


def main(argv: Sequence[str] | None = None) -> int:
    from k3run.checks import CheckpointInvalid
    from k3run.tokenizer import TokenizerError

    parser = build_parser()
    args = parser.parse_args(argv)
    # start-up choices (the cache plan, which kernels run) are logged once each; show them on stderr
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO, format="[k3run] %(message)s", stream=sys.stderr
    )
    try:
        knobs()  # a malformed K3RUN_* variable is refused here, before any work
        rc = int(args.func(args))
        from k3run.distributed import exit_rank, shutdown_distributed

        if shutdown_distributed():  # a torchrun rank: leave without interpreter finalization (see exit_rank)
            exit_rank(rc)
        return rc
    except CheckpointInvalid as e:  # everything wrong with a checkpoint: one line per problem
        if args.traceback:
            raise
        n = len(e.problems)
        print(
            f"k3run: error: {e.where}: checkpoint refused, {n} problem{'' if n == 1 else 's'}:",
            file=sys.stderr,
        )
        for line in e.lines():
            print(f"k3run: error: {line}", file=sys.stderr)
        return 2
    except (
        UserError,
        TokenizerError,
        ValueError,
        FileNotFoundError,
        NotADirectoryError,
        json.JSONDecodeError,
    ) as e:
        # ValueError is what config parsing, the loader and the engine raise for a bad checkpoint or setting
        if args.traceback:
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"k3run: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
