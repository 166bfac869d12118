"""knobs.py: every K3RUN_* variable parsed once into one typed record, malformed values named, the docs table
equal to the fields, and no raw reads of k3run's variables left in src."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from k3run.knobs import Knobs, knobs, override_knobs, reset_knobs, table

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_when_unset_or_empty() -> None:
    want = Knobs(
        cpu_threads=None, cpu_simd="auto", cpu_int8=False, fp8_gemv=True, mla_decode_kernel=True,
        moe_ops=True, moe_by_expert=True, moe_fuse_shared=4, moe_by_expert_tile=None, sm90_cuda=True,
        side_stream=True,
        dist_backend=None, api_key=None,
    )  # fmt: skip
    assert Knobs.from_env({}) == want
    assert Knobs.from_env({row.split("`")[1]: "" for row in table()}) == want


@pytest.mark.parametrize(
    "var, value, field, parsed",
    [
        ("K3RUN_CPU_THREADS", "3", "cpu_threads", 3),
        ("K3RUN_CPU_SIMD", "0", "cpu_simd", "off"),
        ("K3RUN_CPU_SIMD", "off", "cpu_simd", "off"),
        ("K3RUN_CPU_SIMD", "avx2", "cpu_simd", "avx2"),
        ("K3RUN_CPU_INT8", "1", "cpu_int8", True),
        ("K3RUN_CPU_INT8", "0", "cpu_int8", False),
        ("K3RUN_FP8_GEMV", "0", "fp8_gemv", False),
        ("K3RUN_MLA_DECODE_KERNEL", "0", "mla_decode_kernel", False),
        ("K3RUN_MOE_OPS", "0", "moe_ops", False),
        ("K3RUN_MOE_OPS", "1", "moe_ops", True),
        ("K3RUN_MOE_BY_EXPERT", "0", "moe_by_expert", False),
        ("K3RUN_MOE_FUSE_SHARED", "0", "moe_fuse_shared", 0),
        ("K3RUN_MOE_FUSE_SHARED", "128", "moe_fuse_shared", 128),
        ("K3RUN_MOE_BY_EXPERT_TILE", "32", "moe_by_expert_tile", 32),
        ("K3RUN_MOE_EXPERT_SPLIT", "0", "moe_expert_split", 0),
        ("K3RUN_MOE_EXPERT_SPLIT", "4", "moe_expert_split", 4),
        ("K3RUN_SM90_CUDA", "0", "sm90_cuda", False),
        ("K3RUN_SIDE_STREAM", "0", "side_stream", False),
        ("K3RUN_DIST_BACKEND", "gloo", "dist_backend", "gloo"),
        ("K3RUN_API_KEY", "s3cret", "api_key", "s3cret"),
        ("K3RUN_KDA_FUSED_FORM", "16/4/flat", "kda_fused_form", "16/4/flat"),
        ("K3RUN_KDA_FUSED_FORM", "32/4/flat/p2", "kda_fused_form", "32/4/flat/p2"),
        ("K3RUN_KDA_FUSED_FORM", "32/4/p3", "kda_fused_form", "32/4/p3"),
        ("K3RUN_MOE_STREAM", "28/3", "moe_stream", "28/3"),
        ("K3RUN_MOE_STREAM", "0", "moe_stream", "0"),
    ],
)
def test_each_variable_sets_its_field(var, value, field, parsed) -> None:
    assert getattr(Knobs.from_env({var: value}), field) == parsed


FORM_EXPECTED = (
    "BV/warps, BV/warps/flat, optionally /pN after them; BV 8 to 128 a power of two, warps 1, 2, 4 or 8, N 1 "
    "to 8"
)

STREAM_EXPECTED = "R/S with R 1 to 32 programs an SM and S 2 to 8 ring slots, or 0"


@pytest.mark.parametrize(
    "var, value, expected",
    [
        ("K3RUN_CPU_THREADS", "two", "a positive integer"),
        ("K3RUN_CPU_THREADS", "0", "a positive integer"),
        ("K3RUN_CPU_SIMD", "avx512", "avx2, 0 or off"),
        ("K3RUN_CPU_INT8", "yes", "0 or 1"),
        ("K3RUN_MOE_OPS", "false", "0 or 1"),
        ("K3RUN_SIDE_STREAM", "off", "0 or 1"),
        ("K3RUN_MOE_BY_EXPERT_TILE", "24", "8, 16 or 32"),
        ("K3RUN_MOE_EXPERT_SPLIT", "9", "a split from 0 to 8"),
        ("K3RUN_MOE_EXPERT_SPLIT", "auto", "a split from 0 to 8"),
        ("K3RUN_MOE_FUSE_SHARED", "129", "a token count from 0 to 128"),
        ("K3RUN_MOE_FUSE_SHARED", "on", "a token count from 0 to 128"),
        ("K3RUN_DIST_BACKEND", "mpi", "'nccl' or 'gloo'"),
        ("K3RUN_KDA_FUSED_FORM", "24/4", FORM_EXPECTED),
        ("K3RUN_KDA_FUSED_FORM", "32/4/flt", FORM_EXPECTED),
        ("K3RUN_KDA_FUSED_FORM", "32", FORM_EXPECTED),
        ("K3RUN_KDA_FUSED_FORM", "32/4/p2/flat", FORM_EXPECTED),
        ("K3RUN_KDA_FUSED_FORM", "32/4/flat/p9", FORM_EXPECTED),
        ("K3RUN_KDA_FUSED_FORM", "32/4/flat/p", FORM_EXPECTED),
        ("K3RUN_MOE_STREAM", "33/2", STREAM_EXPECTED),
        ("K3RUN_MOE_STREAM", "28/1", STREAM_EXPECTED),
        ("K3RUN_MOE_STREAM", "28", STREAM_EXPECTED),
        ("K3RUN_MOE_STREAM", "on", STREAM_EXPECTED),
    ],
)
def test_malformed_values_name_variable_values_and_value(var, value, expected) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{var}: expected {expected}, got {value!r}")):
        Knobs.from_env({var: value})


def test_the_api_key_stays_out_of_the_repr() -> None:
    assert "s3cret" not in repr(Knobs.from_env({"K3RUN_API_KEY": "s3cret"}))


def test_parsed_once_until_reset(monkeypatch) -> None:
    monkeypatch.delenv("K3RUN_MOE_OPS", raising=False)
    reset_knobs()
    first = knobs()
    assert first.moe_ops
    monkeypatch.setenv("K3RUN_MOE_OPS", "0")
    assert knobs() is first  # a change inside the process is not read ...
    reset_knobs()
    assert not knobs().moe_ops  # ... until the next parse


def test_override_nests_and_restores() -> None:
    base = knobs()
    with override_knobs(cpu_int8=True) as a:
        assert knobs() is a and a.cpu_int8
        with override_knobs(moe_by_expert_tile=16):
            assert knobs().cpu_int8 and knobs().moe_by_expert_tile == 16
        assert knobs() is a
    assert knobs() is base


def test_docs_table_lists_every_field() -> None:
    doc = (ROOT / "docs" / "knobs.md").read_text()
    for row in table():
        assert row in doc, row
    assert "docs/knobs.md" in (ROOT / "README.md").read_text()


def test_src_reads_k3run_variables_only_through_knobs() -> None:
    raw = re.compile(r"(environ|getenv)\W[^\n]*K3RUN_")
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted((ROOT / "src").rglob("*.py"))
        if p.name != "knobs.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if raw.search(line)
    ]
    assert not found, found


def test_cli_refuses_a_malformed_variable_before_any_work(monkeypatch, capsys) -> None:
    from k3run.cli import main

    monkeypatch.setenv("K3RUN_MOE_OPS", "false")
    reset_knobs()
    assert main(["inspect", str(ROOT / "no-such-checkpoint")]) == 2
    err = capsys.readouterr().err
    assert "k3run: error: K3RUN_MOE_OPS: expected 0 or 1, got 'false'" in err and "no-such" not in err
