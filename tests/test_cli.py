"""`k3run` command line: user mistakes give one line on stderr and exit code 2."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3run.cli import main
from k3run.engine import LLM, EngineConfig, SamplingParams
from k3run.tokenizer import load_tokenizer

from .engine.conftest import write_char_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own exits
        rc = int(e.code)
    err = capsys.readouterr().err
    return rc, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "{tmp}/missing", "--prompt", "x"], "MODEL {tmp}/missing: no such directory"),
        (["generate", "{tmp}/file.txt", "--prompt", "x"], "not a directory"),
        (["eval", "{tmp}", "--text", "x"], "DIR {tmp}: no config.json"),
        (
            ["generate", str(FIXTURES / "llama_nvfp4"), "--prompt", "x"],
            "expected 'kimi_linear' or 'kimi_k3', got 'llama'",
        ),
        (["generate", "{tmp}", "--prompt", "x", "--bogus"], "unrecognized arguments: --bogus"),
        (["generate", "{tmp}"], "the following arguments are required: --prompt"),
        (["quantize", "a", "b", "--recipe", "int3"], "invalid choice: 'int3'"),
        (["bench", "{tmp}", "--batch-sizes", "1,0"], "expected a positive integer, got 0"),
        (["generate", "{tmp}", "--prompt", "x", "--threads", "0"], "expected a positive integer, got 0"),
        (["generate", "{kimi}", "--prompt", "x", "--top-p", "1.5"], "top_p must be in (0, 1], got 1.5"),
        (["eval", "{kimi}", "--text", "{tmp}/none.txt"], "--text {tmp}/none.txt: no such file"),
        (["quantize", "{kimi}", "{tmp}", "--recipe", "nvfp4"], "exists and is not empty"),
        (["inspect", "{tmp}/missing"], "DIR {tmp}/missing: no such directory"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_user_mistakes_print_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    (tmp_path / "file.txt").write_text("x")
    kimi = FIXTURES / "kimi_linear_bf16"
    fill = {"tmp": str(tmp_path), "kimi": str(kimi)}
    rc, err = _run(capsys, [a.format(**fill) for a in argv])
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert message.format(**fill) in lines[0]


def test_wrong_model_type_from_a_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = json.loads((FIXTURES / "kimi_linear_bf16" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_experts_per_token": 99}))
    rc, err = _run(capsys, ["generate", str(tmp_path), "--prompt", "x"])
    assert rc == 2 and "num_experts_per_token" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "config.json").write_text("{not json")
    rc, err = _run(capsys, ["generate", str(tmp_path), "--prompt", "x"])
    assert rc == 2 and "not valid JSON" in err


def test_real_process_exit_code_and_no_traceback(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "k3run.cli", "generate", str(tmp_path / "nope"), "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"k3run: error: MODEL {tmp_path / 'nope'}: no such directory"
    assert proc.stdout == ""


@pytest.fixture(scope="module")
def kimi_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The bf16 and NVFP4 tiny Kimi Linear fixtures, each with a character tokenizer (vocab 97 <= 128)."""
    pytest.importorskip("k3run.api")
    root = tmp_path_factory.mktemp("cli")
    out = []
    for name in ("kimi_linear_bf16", "kimi_linear_nvfp4"):
        d = root / name
        shutil.copytree(FIXTURES / name, d)
        write_char_tokenizer(d)
        out.append(d)
    (root / "heldout.txt").write_text("def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n" * 3)
    return out[0], out[1]


def test_generate_streams_the_greedy_text_and_reports_speed(
    kimi_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    bf16, _ = kimi_dirs
    rc = main(
        [
            "generate",
            str(bf16),
            "--prompt",
            "def f(",
            "--max-tokens",
            "6",
            "--temperature",
            "0",
            "--ignore-eos",
            "--device",
            "cpu",
            "--dtype",
            "fp32",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0
    expect = LLM(bf16, dtype=torch.float32, config=EngineConfig(max_num_seqs=1, max_model_len=64)).generate(
        ["def f("], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    )[0]
    assert captured.out == "def f(" + expect.text + "\n"
    assert "[k3run] 6 tokens in" in captured.err and "tokens/s" in captured.err


def test_eval_perplexity_kl_and_agreement(
    kimi_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    load_model = pytest.importorskip("k3run.api").load_model
    bf16, nvfp4 = kimi_dirs
    rc = main(
        [
            "eval",
            str(nvfp4),
            "--reference",
            str(bf16),
            "--window",
            "32",
            "--device",
            "cpu",
            "--dtype",
            "fp32",
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    row = next(line for line in out.splitlines() if line.startswith(str(nvfp4)))
    ppl, rel, kl, agree = row[len(str(nvfp4)) :].split()
    # recompute all three numbers independently, window by window
    text = (bf16.parent / "heldout.txt").read_text()
    ids = load_tokenizer(nvfp4).encode(text, add_special_tokens=False)
    model, ref = load_model(nvfp4, dtype=torch.float32), load_model(bf16, dtype=torch.float32)
    nll, kl_sum, same, n = 0.0, 0.0, 0, 0
    for i in range(0, len(ids), 32):
        w = torch.tensor(ids[i : i + 32])
        if w.numel() < 2:
            continue
        logp = model.logits(w)[:-1].log_softmax(-1)
        ref_logp = ref.logits(w)[:-1].log_softmax(-1)
        nll -= logp.gather(-1, w[1:, None]).sum().item()
        kl_sum += torch.nn.functional.kl_div(logp, ref_logp, log_target=True, reduction="sum").item()
        same += (logp.argmax(-1) == ref_logp.argmax(-1)).sum().item()
        n += w.numel() - 1
    # the table prints 4-5 significant digits
    assert math.isclose(float(ppl), math.exp(nll / n), rel_tol=1e-4)
    assert math.isclose(float(kl), kl_sum / n, rel_tol=1e-3, abs_tol=1e-5)
    assert math.isclose(float(agree.rstrip("%")), 100 * same / n, abs_tol=0.01)
    assert kl_sum > 0  # NVFP4 weights do move the distribution
    rc = main(
        ["eval", str(bf16), "--reference", str(bf16), "--window", "32", "--device", "cpu", "--no-progress"]
    )
    ref_row, row = [
        line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(f"{bf16} ")
    ]
    assert ref_row[1] == "(reference)" and ref_row[2] == row[1]
    assert row[2:] == ["+0.00%", "0.00000", "100.00%"]


def test_bench_prints_a_row_per_batch_size(
    kimi_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    bf16, _ = kimi_dirs
    rc = main(
        [
            "bench",
            str(bf16),
            "--batch-sizes",
            "1,3",
            "--prompt-len",
            "8",
            "--decode-tokens",
            "4",
            "--device",
            "cpu",
            "--no-progress",
        ]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    rows = [line.split() for line in lines[-2:]]
    assert [r[0] for r in rows] == ["1", "3"]
    assert all(float(x) > 0 for r in rows for x in r[1:])
    assert lines[-4].endswith("decode steps: eager")  # the CPU: no graphs, so no overlap either


def test_quantize_then_inspect_then_generate(
    kimi_dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bf16, _ = kimi_dirs
    dst = tmp_path / "nvfp4"
    assert main(["quantize", str(bf16), str(dst), "--recipe", "nvfp4"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["inspect", str(dst), "--device", "cpu"]) == 0
    table = capsys.readouterr().out
    assert (
        "model.layers.0.self_attn.q_proj" in table
        and "NVFP4" in table
        and "parameter bytes by scheme" in table
    )
    # the exporter carries the tokenizer over, so the quantized checkpoint generates directly
    argv = ["generate", str(dst), "--prompt", "ab", "--max-tokens", "3", "--temperature", "0", "--ignore-eos"]
    assert main([*argv, "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("ab")


def test_run_default_generates_from_the_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    """`make run` streams from the bundled k3-mixed model and reports its speed."""
    from k3run.cli import DEFAULT_PROMPT

    assert main(["run-default"]) == 0
    captured = capsys.readouterr()
    assert DEFAULT_PROMPT in captured.out and "tokens/s" in captured.err


def test_generate_chat_uses_the_template(
    kimi_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    bf16, _ = kimi_dirs
    d = bf16.parent / "chat"
    shutil.copytree(bf16, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "[user]{{ messages[0].content }}{% if add_generation_prompt %}[bot]{% endif %}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    argv = ["generate", str(d), "--chat", "--prompt", "hi", "--max-tokens", "5", "--temperature", "0"]
    assert main([*argv, "--ignore-eos", "--device", "cpu", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    llm = LLM(d, dtype=torch.float32, config=EngineConfig(max_num_seqs=1, max_model_len=64))
    ids = llm.tokenizer.encode("[user]hi[bot]", add_special_tokens=False)
    expect = llm.generate([ids], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert out == expect.text + "\n"


def test_eval_of_the_bundled_model_uses_its_heldout_text(capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's bar: the k3-mixed model's held-out perplexity within 5% of its bf16 original."""
    from k3run.cli import ASSETS_DIR, default_model_dir

    quant, bf16 = default_model_dir(), ASSETS_DIR / "default-model-bf16"
    assert quant is not None and quant.name == "default-model-k3-mixed"
    argv = ["eval", str(quant), "--reference", str(bf16), "--max-tokens", "1024", "--no-progress"]
    assert main([*argv, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "held-out: 1020 predicted tokens in 4 windows" in out
    row = next(line.split() for line in out.splitlines() if line.startswith(str(quant)))
    ppl, rel, kl, agree = row[1:]
    assert abs(float(rel.rstrip("%"))) < 5.0 and 0 < float(kl) < 0.05 and float(agree.rstrip("%")) > 90


def test_serve_compiles_the_cpu_decode_of_a_model_of_small_matrices_unless_told() -> None:
    """`k3run serve` on the CPU compiles a small model's decode steps by default (eager, they are per-op
    dispatch); --eager, tensor parallelism and a model with a matrix of MIN_WEIGHTS or more keep them
    eager."""
    from k3run.api import load_model
    from k3run.cli import _compile_small_model, build_parser
    from k3run.kernels import cpu_fused

    bundled = Path(__file__).resolve().parents[1] / "assets" / "default-model-k3-mixed"
    model = load_model(bundled, device="cpu")
    args = build_parser().parse_args(["serve", str(bundled)])
    assert _compile_small_model(args, model, tp_size=1)
    assert not _compile_small_model(build_parser().parse_args(["serve", str(bundled), "--eager"]), model, 1)
    assert not _compile_small_model(args, model, tp_size=2)
    explicit = build_parser().parse_args(["serve", str(bundled), "--compile"])
    assert not _compile_small_model(explicit, model, 1)  # asked for: the engine config has it already
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_fused, "MIN_WEIGHTS", 1000)  # every matrix of the bundled model is over this
        assert not _compile_small_model(args, model, 1)
