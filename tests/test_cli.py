"""`k3run` command line: user mistakes give one line on stderr and exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from k3run.cli import main

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
