"""Bad checkpoints are refused at load and by `k3run inspect` (exit 2), naming the checkpoint tensor, the
value and its index, or the config field, its value and the tensor that contradicts it (k3run.checks).

Each corrupted checkpoint is a copy of the bundled k3-mixed model (~4 MB: FP8_PB_WO attention, NVFP4 routed
experts, bf16 rest) with one or a few tensors or config fields edited."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3run.api import load_model
from k3run.cli import main

ROOT = Path(__file__).parents[1]
BUNDLED = ROOT / "assets" / "default-model-k3-mixed"
FIXTURES = Path(__file__).parent / "fixtures"
L = "language_model.model.layers"
EXPERT = f"{L}.1.block_sparse_moe.experts.0"  # NVFP4: weight U8 [64, 32], weight_scale E4M3 [64, 4]
Q_PROJ = f"{L}.0.self_attn.q_proj"  # FP8_PB_WO: weight E4M3 [256, 128], weight_scale F32 [2, 1, 1, 1]

Edit = Callable[[dict[str, torch.Tensor]], None]


def _copy(tmp_path: Path, edit: Edit | None = None, config: Callable[[dict], None] | None = None) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(BUNDLED, d)
    if edit is not None:
        tensors = load_file(str(d / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(d / "model.safetensors"))
    if config is not None:
        hf = json.loads((d / "config.json").read_text())
        config(hf["text_config"])
        (d / "config.json").write_text(json.dumps(hf))
    return d


def _set(name: str, index: tuple[int, ...], value: float | None = None, byte: int | None = None) -> Edit:
    def edit(t: dict[str, torch.Tensor]) -> None:
        x = t[name].clone()
        if byte is not None:
            x.view(torch.uint8)[index] = byte
        else:
            x[index] = value
        t[name] = x

    return edit


def _refused(d: Path) -> str:
    """The message load_model refuses `d` with, one line."""
    with pytest.raises(ValueError) as info:
        load_model(d)
    return " ".join(str(info.value).split())


def _inspect(d: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, list[str]]:
    rc = main(["inspect", str(d), "--device", "cpu", *extra])
    err = capsys.readouterr().err
    return rc, [line.removeprefix("k3run: error: ") for line in err.splitlines()]


# values --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("byte", "shown"),
    [(0x7F, r"nan \(byte 0x7f\)"), (0xFF, r"nan \(byte 0xff\)"), (0xB8, r"-1\.0 \(byte 0xb8\)")],
)
def test_invalid_nvfp4_block_scale_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], byte: int, shown: str
) -> None:
    """NaN (both encodings) and negative E4M3 block scales: refused at load (on the device, after the copy)
    and by inspect (on the CPU), naming the tensor, the value, its block and the rule."""
    d = _copy(tmp_path, _set(f"{EXPERT}.w1.weight_scale", (3, 1), byte=byte))
    line = (
        rf"tensor {EXPERT}\.w1\.weight_scale: {shown} at \[3, 1\] \(row 3, columns 16\.\.31\); "
        r"NVFP4 E4M3 block scales must be finite and >= 0"
    )
    assert re.search(line, _refused(d))
    rc, lines = _inspect(d, capsys)
    assert rc == 2 and len(lines) == 2, lines
    assert re.fullmatch(line, lines[1]), lines


def test_zero_nvfp4_block_scale_is_accepted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A zero E4M3 block scale (0x00, or -0 = 0x80) is a valid value: its 16-element group decodes to zeros
    and nothing else changes."""

    def edit(t: dict[str, torch.Tensor]) -> None:
        _set(f"{EXPERT}.w1.weight_scale", (3, 1), byte=0x00)(t)
        _set(f"{EXPERT}.w1.weight_scale", (3, 2), byte=0x80)(t)

    model = load_model(_copy(tmp_path, edit))
    reference = load_model(BUNDLED)
    w13 = model.layers[1].mlp.experts.scheme.ref_stack[0][0]  # expert 0's decoded [w1; w3], fp32 [2I, D]
    ref = reference.layers[1].mlp.experts.scheme.ref_stack[0][0]
    assert bool((ref[3, 16:48] != 0).any()) and bool((w13[3, 16:48] == 0).all())
    w13[3, 16:48] = ref[3, 16:48]
    assert torch.equal(w13, ref)
    assert _inspect(_copy(tmp_path / "again", edit), capsys)[0] == 0


@pytest.mark.parametrize(
    ("name", "index", "value"),
    [
        ("language_model.model.embed_tokens.weight", (7, 5), float("nan")),
        (f"{L}.1.input_layernorm.weight", (5,), float("inf")),
        (f"{L}.1.block_sparse_moe.gate.e_score_correction_bias", (2,), float("nan")),
        (f"{L}.1.block_sparse_moe.gate.weight", (2, 9), float("-inf")),
        (f"{L}.0.self_attn.q_conv1d.weight", (4, 0, 1), float("nan")),
        (f"{L}.2.mlp_res_proj.weight", (0, 3), float("nan")),
        (f"{L}.1.block_sparse_moe.shared_experts.up_proj.weight", (0, 5), float("nan")),
        (f"{L}.0.self_attn.dt_bias", (11,), float("nan")),
    ],
)
def test_non_finite_weight_is_refused_naming_the_tensor(
    tmp_path: Path, name: str, index: tuple[int, ...], value: float
) -> None:
    """NaN / Inf anywhere in a weight, whatever loads it (norms, embeddings, router, conv, AttnRes, fused
    linears): refused at load with the checkpoint name and the index, before generation could fail later."""
    d = _copy(tmp_path, _set(name, index, value))
    shown = "nan" if value != value else repr(value)
    assert f"tensor {name}: {shown} at {list(index)}; weights must be finite" in _refused(d)


def test_nan_fp8_weight_byte_is_refused(tmp_path: Path) -> None:
    d = _copy(tmp_path, _set(f"{Q_PROJ}.weight", (130, 7), byte=0xFF))
    assert (
        f"tensor {Q_PROJ}.weight: nan (byte 0xff) at [130, 7]; FP8 E4M3 weights must not be NaN"
        in _refused(d)
    )


@pytest.mark.parametrize("value", [0.0, -0.5, float("nan"), float("inf")])
def test_invalid_fp8_block_scale_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: float
) -> None:
    """FP8_PB_WO fp32 128x128 block scales must be finite and > 0: ModelOpt writes amax/448 and 1.0 for an
    all-zero tile (tests/fixtures), so a 0 would silently zero a whole tile of the output."""
    d = _copy(tmp_path, _set(f"{Q_PROJ}.weight_scale", (1, 0, 0, 0), value))
    shown = "nan" if value != value else repr(value)
    line = (
        f"tensor {Q_PROJ}.weight_scale: {shown} at block [1, 0, 0, 0] (rows 128.., columns 0..); "
        "FP8_PB_WO block scales must be finite and > 0"
    )
    assert line in _refused(d)
    rc, lines = _inspect(d, capsys)
    assert rc == 2 and lines[1].startswith(line), lines


@pytest.mark.parametrize(("suffix", "value"), [("w2.weight_scale_2", 0.0), ("w3.input_scale", float("nan"))])
def test_invalid_global_scales_are_refused(tmp_path: Path, suffix: str, value: float) -> None:
    d = _copy(tmp_path, _set(f"{EXPERT}.{suffix}", (), value))
    shown = "nan" if value != value else repr(value)
    assert f"tensor {EXPERT}.{suffix}: {shown} (the scalar); scales must be finite and > 0" in _refused(d)


# config against tensors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "line"),
    [
        (
            {"hidden_size": 96},
            r"config text_config\.hidden_size = 96 but tensor language_model\.\S+\.weight has shape "
            r"\[\d+, 128\]; expected \[\d+, 96\] \(and \d+ more tensors disagreeing with it\)",
        ),
        (
            {"num_experts": 6},
            rf"config text_config\.num_experts = 6 but tensor {L}\.1\.block_sparse_moe\.gate\."
            r"e_score_correction_bias has shape \[8\]; expected \[6\]",
        ),
        (
            {"num_attention_heads": 4},
            rf"config text_config\.num_attention_heads \* \S+ = 4 \* .* but tensor {L}\.3\.self_attn\."
            r"\S+\.weight has shape \[\d+, 128\]",
        ),
        (
            {"linear_attn_config.num_heads": 4},
            rf"config text_config\.linear_attn_config\.num_heads = 4 but tensor {L}\.0\.self_attn\.A_log "
            r"has shape \[2\]; expected \[4\]",
        ),
        (
            {
                "num_hidden_layers": 6,
                "linear_attn_config.kda_layers": [1, 2, 3, 5, 6],
                "linear_attn_config.full_attn_layers": [4],
            },
            rf"config text_config\.num_hidden_layers = 6 but the checkpoint has tensor {L}\.6\.\S+ "
            r"\(layer 6\)",
        ),
    ],
    ids=["hidden_size", "num_experts", "mla_heads", "kda_heads", "num_hidden_layers"],
)
def test_config_mismatch_names_the_field_its_value_and_the_tensor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fields: dict[str, object], line: str
) -> None:
    """Not a scale tensor, not an internal parameter name ('in_proj', '(shard 0)'), not 'norm weight'."""

    def edit(text: dict) -> None:
        for field, value in fields.items():
            node = text
            *path, last = field.split(".")
            for part in path:
                node = node[part]
            node[last] = value

    d = _copy(tmp_path, config=edit)
    message = _refused(d)
    assert re.search(line, message), message
    for internal in ("(shard", "in_proj", "gate_up_proj", "norm weight", "w13_"):
        assert internal not in message
    rc, lines = _inspect(d, capsys)
    assert rc == 2 and any(re.fullmatch(line + r".*", x) for x in lines[1:]), lines


def test_unused_tensors_name_the_config_field_that_rules_them_out(tmp_path: Path) -> None:
    """A KDA conv weight in an MLA layer, and a ninth expert of an 8-expert model."""

    def edit(t: dict[str, torch.Tensor]) -> None:
        t[f"{L}.3.self_attn.q_conv1d.weight"] = torch.zeros(256, 1, 4)
        for w in ("w1", "w2", "w3"):
            for s in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
                t[f"{L}.1.block_sparse_moe.experts.8.{w}.{s}"] = t[f"{EXPERT}.{w}.{s}"].clone()

    message = _refused(_copy(tmp_path, edit))
    assert "checkpoint refused, 13 problems" in message  # the ninth expert's layer checks add nothing
    assert (
        "config text_config.linear_attn_config.kda_layers makes layer 3 (0-indexed) a full-attention (MLA) "
        f"layer, but tensor {L}.3.self_attn.q_conv1d.weight belongs to the other kind of layer" in message
    )
    assert (
        f"config text_config.num_experts = 8 but the checkpoint has tensor {L}.1.block_sparse_moe.experts.8."
        "w1.input_scale (expert 8) (and 11 more tensors disagreeing with it)" in message
    )


def test_inspect_lists_every_problem_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing tensor, an unused one, a NaN NVFP4 block scale and a zero FP8 block scale in one
    checkpoint: inspect names all four (one line each, after a head line), not just the first."""

    def edit(t: dict[str, torch.Tensor]) -> None:
        del t[f"{L}.2.self_attn.o_norm.weight"]
        t[f"{L}.2.self_attn.bogus.weight"] = torch.zeros(4)
        _set(f"{EXPERT}.w2.weight_scale", (5, 2), byte=0x7F)(t)
        _set(f"{Q_PROJ}.weight_scale", (0, 0, 0, 0), 0.0)(t)

    d = _copy(tmp_path, edit)
    rc, lines = _inspect(d, capsys)
    assert rc == 2
    assert lines[0] == f"{d}: checkpoint refused, 4 problems:"
    assert sorted(lines[1:]) == sorted(
        [
            f"tensor {L}.2.self_attn.bogus.weight: a model with this config has no such tensor (not used)",
            f"tensor {L}.2.self_attn.o_norm.weight is missing (config text_config.linear_attn_config."
            "kda_layers: layer 2 (0-indexed) is a KDA layer)",
            f"tensor {EXPERT}.w2.weight_scale: nan (byte 0x7f) at [5, 2] (row 5, columns 32..47); NVFP4 E4M3 "
            "block scales must be finite and >= 0",
            f"tensor {Q_PROJ}.weight_scale: 0.0 at block [0, 0, 0, 0] (rows 0.., columns 0..); FP8_PB_WO "
            "block scales must be finite and > 0 (ModelOpt: amax/448, 1.0 for a zero tile)",
        ]
    )
    # the header problems alone refuse the load before the model is built
    assert _refused(d).count("; tensor ") == 1


def test_inspect_caps_the_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """23 missing norms: 20 lines, then a count of the rest."""
    names = [f"{L}.{i}.{n}.weight" for i in range(8) for n in ("input_layernorm", "post_attention_layernorm")]
    names += [f"{L}.{i}.mlp_res_norm.weight" for i in range(7)]
    d = _copy(tmp_path, lambda t: [t.pop(n) for n in names])
    rc, lines = _inspect(d, capsys)
    assert rc == 2 and lines[0].endswith("checkpoint refused, 23 problems:")
    assert len(lines) == 1 + 20 + 1 and lines[-1] == "... and 3 more problems"
    assert all(" is missing" in line for line in lines[1:-1])


def test_inspect_headers_only_skips_the_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _copy(tmp_path, _set(f"{Q_PROJ}.weight_scale", (1, 0, 0, 0), 0.0))
    assert _inspect(d, capsys, "--headers-only")[0] == 0
    assert _inspect(d, capsys)[0] == 2


@pytest.mark.parametrize(
    "d",
    [
        BUNDLED,
        ROOT / "assets" / "default-model-bf16",
        FIXTURES / "kimi_linear_bf16",
        FIXTURES / "kimi_linear_nvfp4",
        FIXTURES / "kimi_linear_fp8_pb_wo_h128",
    ],
    ids=lambda p: p.name,
)
def test_valid_checkpoints_pass_every_check(d: Path) -> None:
    """No false alarms on real exports (both namings, every scheme, ModelOpt's zero-tile and clamped
    scales): the config table, the layer checks, the loader's dry run and the scale values all pass."""
    from k3run.checks import validate_checkpoint

    stats: dict[str, int] = {}
    assert validate_checkpoint(d, stats=stats) == []
    if d.name != "kimi_linear_bf16" and d.name != "default-model-bf16":
        assert stats["bytes"] > 0  # the scales were read


# mechanics -----------------------------------------------------------------------------------------------


def test_screen_is_one_allocation_free_reduction_per_parameter_and_no_sync() -> None:
    """Stage 3 on the bundled model: no .item() / bool() per parameter (aten._local_scalar_dense), at most
    two reductions per parameter, no elementwise temporaries; one nonzero at the end."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from k3run.checks import screen_parameters

    model = load_model(BUNDLED)
    params = dict(model.named_parameters())
    seen: list[str] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Count():
        assert screen_parameters(params) == []
    screened = sum(1 for p in params.values() if p.dtype != torch.uint8)
    reductions = [s for s in seen if s.split(".")[0] in ("aminmax", "max")]
    assert "_local_scalar_dense" not in seen
    assert screened <= len(reductions) <= 2 * screened
    assert seen.count("nonzero.default") == 1
    heavy = [
        s for s in seen if s.split(".")[0] in ("isfinite", "abs", "sum", "bitwise_and", "ne", "eq", "gt")
    ]
    assert len(heavy) <= 8 * len(params)  # only on the 0-dim results of the reductions


def test_screen_alarm_on_unwritten_padding_is_confirmed_away(tmp_path: Path) -> None:
    """Two FP8 partitions of 64 rows: the second starts at physical row 128, rows 64..127 are never written.
    Padding holding NaN bytes flags the parameter but the checkpoint tensors are clean: the load goes on.
    A NaN in a real row is refused under its checkpoint name."""
    from k3run.layers.linear import MergedColumnParallelLinear
    from k3run.loader import Target, load_checkpoint
    from k3run.quant.schemes import Fp8PbWoScheme
    from tests.tp_utils import checkpoint_tensors

    ckpt = {}
    for p in ("a", "b"):
        ckpt |= {f"{p}.{k}": v for k, v in checkpoint_tensors("fp8", torch.randn(64, 128)).items()}
    save_file(ckpt, str(tmp_path / "model.safetensors"))

    def build() -> torch.nn.Module:
        m = torch.nn.Module()
        m.ab = MergedColumnParallelLinear(
            128, [64, 64], scheme=Fp8PbWoScheme(), prefix="ab", params_dtype=torch.float32
        )
        m.ab.weight.data.view(torch.uint8)[64:128] = 0x7F
        return m

    def mapping(name: str) -> list[Target]:
        part, _, suffix = name.partition(".")
        return [Target(f"ab.{suffix}", "ab".index(part))]

    m = build()
    load_checkpoint(m, tmp_path, mapping, progress=False)
    assert torch.equal(m.ab.weight[64:128].view(torch.uint8), torch.zeros(64, 128, dtype=torch.uint8))
    bad = ckpt["b.weight"].clone()
    bad.view(torch.uint8)[3, 4] = 0x7F
    save_file(ckpt | {"b.weight": bad}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"tensor b\.weight: nan \(byte 0x7f\) at \[3, 4\]"):
        load_checkpoint(build(), tmp_path, mapping, progress=False)


def test_dry_run_reads_nothing_and_collects_every_loader_error(tmp_path: Path) -> None:
    from k3run.checks import CheckpointInvalid
    from k3run.layers.linear import ReplicatedLinear
    from k3run.loader import Target, load_checkpoint
    from k3run.quant.schemes import UnquantizedScheme

    save_file(
        {"x.weight": torch.zeros(16, 24), "y.weight": torch.zeros(8, 8), "z.weight": torch.zeros(3)},
        str(tmp_path / "model.safetensors"),
    )
    with torch.device("meta"):
        m = torch.nn.Module()
        m.x = ReplicatedLinear(32, 16, scheme=UnquantizedScheme())
        m.y = ReplicatedLinear(8, 8, scheme=UnquantizedScheme())
        m.w = ReplicatedLinear(8, 8, scheme=UnquantizedScheme())
    with pytest.raises(CheckpointInvalid) as info:
        load_checkpoint(m, tmp_path, lambda n: None if n == "z.weight" else [Target(n)], dry_run=True)
    found = " | ".join(p.message for p in info.value.problems)
    assert len(info.value.problems) == 3, found
    assert "checkpoint tensor 'x.weight' (F32 [16, 24]) -> parameter 'x.weight'" in found
    assert "expected checkpoint shape (16, 32), got (16, 24)" in found
    assert "no destination in the model (not consumed): ['z.weight']" in found
    assert "2 parameters were not filled by the checkpoint: ['x.weight', 'w.weight']" in found
    assert m.y.weight.device.type == "meta"


def test_compressed_tensors_packed_expert_weights_count_as_the_weight() -> None:
    """MXFP4 experts in compressed-tensors form (moonshotai/Kimi-K3: `weight_packed` U8 [N, K/2], E8M0
    `weight_scale` stored as U8) are the layer's weight for the config checks, not unused tensors."""
    import dataclasses

    from k3run.checks import config_problems
    from k3run.config import ModelConfig
    from k3run.safetensors_io import read_checkpoint_headers

    hf = json.loads((BUNDLED / "config.json").read_text())
    tensors = {}
    for name, info in read_checkpoint_headers(BUNDLED).items():
        if ".experts." in name and name.endswith(".weight"):
            name += "_packed"
        tensors[name] = dataclasses.replace(info, name=name)
    assert config_problems(hf, ModelConfig.from_hf(hf), tensors) == []
