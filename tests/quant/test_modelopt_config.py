from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from k3run.quant.algo import QuantAlgo
from k3run.quant.modelopt import (
    HF_QUANT_CONFIG,
    ModelOptConfig,
    load_quant_config,
    name_variants,
    parse_quant_config,
)

PRODUCER = {"name": "modelopt", "version": "0.47.0"}
EXCLUDES = ["lm_head", "model.embed_tokens", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
# what ModelOpt 0.47 writes for an NVFP4 Qwen3-MoE (shared/spec/modelopt-export-on-cpu.md)
LEGACY_NVFP4 = {
    "producer": PRODUCER,
    "quantization": {
        "quant_algo": "NVFP4",
        "kv_cache_quant_algo": None,
        "group_size": 16,
        "exclude_modules": EXCLUDES,
    },
}
_ACT = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
FLAT_NVFP4 = {
    "config_groups": {"group_0": {"input_activations": _ACT, "weights": dict(_ACT), "targets": ["Linear"]}},
    "ignore": EXCLUDES,
    "quant_algo": "NVFP4",
    "producer": PRODUCER,
    "quant_method": "modelopt",
}
FLAT_FP8_PB_WO = {
    "ignore": ["lm_head"],
    "quant_algo": "fp8_pb_wo",
    "producer": PRODUCER,
    "quant_method": "modelopt",
}


def _mixed(layers: dict[str, dict], excludes: list[str] | None = None) -> ModelOptConfig:
    return parse_quant_config(
        {
            "producer": PRODUCER,
            "quantization": {
                "quant_algo": "MIXED_PRECISION",
                "kv_cache_quant_algo": None,
                "quantized_layers": layers,
                "exclude_modules": excludes or [],
            },
        }
    )


def test_legacy_and_flat_forms_agree() -> None:
    legacy = parse_quant_config(LEGACY_NVFP4)
    flat = parse_quant_config(FLAT_NVFP4)
    assert legacy == flat and hash(legacy) == hash(flat)
    for cfg in (legacy, flat):
        assert cfg.quant_algo == "NVFP4"
        assert cfg.exclude_modules == tuple(EXCLUDES)
        assert cfg.group_size == 16
        assert cfg.kv_cache_quant_algo is None
        assert cfg.producer == PRODUCER
        assert cfg.algos == {QuantAlgo.NVFP4}
        assert cfg.resolve("model.layers.1.self_attn.q_proj") == QuantAlgo.NVFP4
        assert cfg.resolve("model.layers.1.mlp.gate") == QuantAlgo.NONE
        assert cfg.resolve("lm_head") == QuantAlgo.NONE


def test_algo_is_case_insensitive() -> None:
    assert parse_quant_config(FLAT_FP8_PB_WO).quant_algo == "FP8_PB_WO"
    assert parse_quant_config(FLAT_FP8_PB_WO | {"quant_algo": "Fp8"}).quant_algo == "FP8"
    legacy = {"quantization": {"quant_algo": "fp8_pb_wo", "kv_cache_quant_algo": None, "exclude_modules": []}}
    assert parse_quant_config(legacy).resolve("model.layers.0.self_attn.o_proj") == QuantAlgo.FP8_PB_WO


def test_unknown_algo_lists_supported() -> None:
    with pytest.raises(ValueError, match=r"quant_algo: unsupported .*'INT4_AWQ'.*FP8, FP8_PB_WO, NVFP4"):
        parse_quant_config(FLAT_NVFP4 | {"quant_algo": "INT4_AWQ"})
    with pytest.raises(ValueError, match="quant_algo: expected a quantization algorithm name"):
        parse_quant_config({"quant_method": "modelopt"})


def test_flat_form_requires_modelopt_method() -> None:
    with pytest.raises(ValueError, match="quant_method: expected modelopt.*'compressed-tensors'"):
        parse_quant_config(FLAT_NVFP4 | {"quant_method": "compressed-tensors"})
    assert parse_quant_config(FLAT_NVFP4 | {"quant_method": "ModelOpt_FP4"}).quant_algo == "NVFP4"


def test_legacy_nvfp4_requires_keys_and_group_16() -> None:
    body = dict(LEGACY_NVFP4["quantization"])
    del body["kv_cache_quant_algo"], body["exclude_modules"]
    with pytest.raises(ValueError, match="lacks required key.*kv_cache_quant_algo, exclude_modules"):
        parse_quant_config({"quantization": body})
    with pytest.raises(ValueError, match="group_size: NVFP4 blocks are 16 elements, got 32"):
        parse_quant_config(FLAT_NVFP4 | {"group_size": 32})
    with pytest.raises(ValueError, match="group_size must be an integer, got 'x'"):
        parse_quant_config(FLAT_NVFP4 | {"group_size": "x"})
    with pytest.raises(ValueError, match="ignore: the exclude list must be a list"):
        parse_quant_config(FLAT_NVFP4 | {"ignore": "lm_head"})


def test_kv_cache_scheme() -> None:
    fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
    assert parse_quant_config(FLAT_NVFP4 | {"kv_cache_scheme": fp8}).kv_cache_quant_algo == "FP8"
    assert (
        parse_quant_config(FLAT_NVFP4 | {"kv_cache_scheme": fp8 | {"num_bits": 4}}).kv_cache_quant_algo
        is None
    )
    legacy = json.loads(json.dumps(LEGACY_NVFP4))
    legacy["quantization"]["kv_cache_quant_algo"] = "fp8"
    assert parse_quant_config(legacy).kv_cache_quant_algo == "FP8"


def test_nvfp4_without_activation_groups_is_w4a16() -> None:
    groups = {
        "group_0": {"weights": dict(_ACT), "input_activations": None},
        "group_1": {"weights": dict(_ACT)},
    }
    cfg = parse_quant_config(FLAT_NVFP4 | {"config_groups": groups})
    assert cfg.quant_algo == "W4A16_NVFP4"
    assert cfg.resolve("model.layers.0.mlp.up_proj") == QuantAlgo.W4A16_NVFP4
    one_with_act = groups | {"group_2": {"weights": dict(_ACT), "input_activations": dict(_ACT)}}
    assert parse_quant_config(FLAT_NVFP4 | {"config_groups": one_with_act}).quant_algo == "NVFP4"


def test_exclude_exact_substring_and_glob() -> None:
    cfg = parse_quant_config(
        FLAT_FP8_PB_WO | {"ignore": ["lm_head", "model.layers.1.self_attn", "*.mlp.gate"]}
    )
    assert cfg.is_excluded("lm_head")
    # legacy substring rule: listing a parent module excludes its children
    assert cfg.is_excluded("model.layers.1.self_attn.q_proj")
    assert not cfg.is_excluded("model.layers.2.self_attn.q_proj")
    # substring rule also sees the name without a "language_model." wrapper
    assert cfg.is_excluded("language_model.model.layers.1.self_attn.o_proj")
    # glob: * crosses dots; a pattern not ending in * is anchored at the end
    assert cfg.is_excluded("model.layers.7.mlp.gate")
    assert not cfg.is_excluded("model.layers.7.mlp.gate_proj")
    assert cfg.resolve("model.layers.7.mlp.down_proj") == QuantAlgo.FP8_PB_WO


def test_trailing_star_glob_rewrite_stops_at_siblings() -> None:
    cfg = parse_quant_config(FLAT_NVFP4 | {"ignore": ["*block_sparse_moe.gate*", "lm_head*"]})
    assert cfg.is_excluded("model.layers.1.block_sparse_moe.gate")
    assert cfg.is_excluded("model.layers.1.block_sparse_moe.gate.sub")
    # the raw glob *block_sparse_moe.gate* would match this sibling; the rewritten pair must not
    assert not cfg.is_excluded("model.layers.1.block_sparse_moe.gate_up")
    assert not cfg.is_excluded("model.layers.1.block_sparse_moe.gate_up_proj")
    assert cfg.resolve("model.layers.1.block_sparse_moe.gate_up") == QuantAlgo.NVFP4
    assert cfg.is_excluded("lm_head")
    # a pattern whose star follows a dot is left alone
    dot = parse_quant_config(FLAT_NVFP4 | {"ignore": ["model.layers.2.*"]})
    assert dot.is_excluded("model.layers.2.mlp.up_proj")
    assert not dot.is_excluded("model.layers.21.mlp.up_proj")


def test_exclude_matches_other_spellings() -> None:
    cfg = parse_quant_config(FLAT_NVFP4 | {"ignore": ["model.layers.3.mlp.gate"]})
    assert cfg.is_excluded("language_model.model.layers.3.block_sparse_moe.gate")
    assert cfg.is_excluded("layers.3.mlp.gate")
    assert not cfg.is_excluded("language_model.model.layers.3.block_sparse_moe.experts.0.w1")


def test_fused_exclusion_needs_all_shards() -> None:
    q, k, v = (f"model.layers.0.self_attn.{p}_proj" for p in "qkv")
    cfg = parse_quant_config(FLAT_NVFP4 | {"ignore": [q, k, v]})
    assert cfg.is_excluded("model.layers.0.self_attn.qkv_proj")  # default shards for qkv_proj
    assert cfg.resolve("model.layers.0.self_attn.qkv_proj", (q, k, v)) == QuantAlgo.NONE
    partial = parse_quant_config(FLAT_NVFP4 | {"ignore": [q, k]})
    with pytest.raises(
        ValueError, match=r"qkv_proj: exclude_modules covers only some shards.*v_proj: quantized"
    ):
        partial.resolve("model.layers.0.self_attn.qkv_proj")
    direct = parse_quant_config(FLAT_NVFP4 | {"ignore": ["model.layers.0.self_attn.qkv_proj"]})
    assert direct.resolve("model.layers.0.self_attn.qkv_proj", (q, k, v)) == QuantAlgo.NONE
    # the legacy substring rule is not applied to the fused name itself: the router entry "mlp.gate" is a
    # substring of "mlp.gate_up_proj" but must not decide for the fused expert shards below
    router = parse_quant_config(FLAT_NVFP4 | {"ignore": ["model.layers.4.mlp.gate"]})
    shards = ("model.layers.4.mlp.experts.0.w1", "model.layers.4.mlp.experts.0.w3")
    assert router.resolve("model.layers.4.mlp.gate_up_proj", shards) == QuantAlgo.NVFP4


def test_vision_tower_unquantized_for_single_algo() -> None:
    cfg = parse_quant_config(FLAT_FP8_PB_WO)
    assert cfg.resolve("vision_tower.blocks.0.attn.qkv") == QuantAlgo.NONE
    assert cfg.resolve("model.layers.0.self_attn.q_proj") == QuantAlgo.FP8_PB_WO


def test_mixed_lookup_spellings_experts_and_fused() -> None:
    nv = {"quant_algo": "NVFP4", "group_size": 16}
    pb = {"quant_algo": "FP8_PB_WO"}
    layers = {
        "language_model.model.layers.1.self_attn.q_a_proj": pb,
        "language_model.model.layers.1.self_attn.kv_a_proj_with_mqa": pb,
        "model.layers.1.mlp.experts.0.w1": nv,
        "model.layers.1.mlp.experts.0.w3": nv,
        "model.layers.1.mlp.experts.1.w2": nv,
        "layers.2.self_attn.q_proj": pb,
        "layers.2.self_attn.k_proj": {"quant_algo": "nvfp4", "group_size": 16},
        "model.layers.3.self_attn.fused_qkv_a_proj": pb,
    }
    cfg = _mixed(layers, excludes=["model.layers.1.self_attn.kv_b_proj"])
    assert cfg.is_mixed and cfg.group_size == 16
    assert cfg.algos == {QuantAlgo.FP8_PB_WO, QuantAlgo.NVFP4}
    # HF path spelled under another root
    assert cfg.resolve("model.layers.1.self_attn.q_a_proj") == QuantAlgo.FP8_PB_WO
    assert cfg.resolve("layers.1.self_attn.q_a_proj") == QuantAlgo.FP8_PB_WO
    # mlp <-> block_sparse_moe, and the language_model root
    assert cfg.resolve("language_model.model.layers.1.block_sparse_moe.experts.0.w1") == QuantAlgo.NVFP4
    # not listed or excluded -> NONE
    assert cfg.resolve("model.layers.1.self_attn.o_proj") == QuantAlgo.NONE
    assert cfg.resolve("model.layers.1.self_attn.kv_b_proj") == QuantAlgo.NONE
    # an experts container takes the algorithm of its children
    assert cfg.resolve("model.layers.1.block_sparse_moe.experts") == QuantAlgo.NVFP4
    # fused via shards: all agree
    base = "model.layers.1.self_attn."
    shards = (base + "q_a_proj", base + "kv_a_proj_with_mqa")
    assert cfg.resolve(base + "fused_qkv_a_proj", shards) == QuantAlgo.FP8_PB_WO
    # a directly listed fused name
    assert cfg.resolve("model.layers.3.self_attn.fused_qkv_a_proj") == QuantAlgo.FP8_PB_WO
    # shards that disagree, and listed next to unlisted
    s2 = ("model.layers.2.self_attn.q_proj", "model.layers.2.self_attn.k_proj")
    with pytest.raises(
        ValueError, match=r"Mixed quant_algo within fused layer .*q_proj: FP8_PB_WO.*k_proj: NVFP4"
    ):
        cfg.resolve("model.layers.2.self_attn.qk_proj", s2)
    s3 = s2[:1] + ("model.layers.2.self_attn.v_proj",)
    with pytest.raises(ValueError, match=r"Mixed quant_algo within fused layer .*v_proj: NONE"):
        cfg.resolve("model.layers.2.self_attn.qv_proj", s3)


def test_mixed_experts_with_two_algos_is_an_error() -> None:
    cfg = _mixed(
        {
            "model.layers.1.mlp.experts.0.w1": {"quant_algo": "NVFP4"},
            "model.layers.1.mlp.experts.1.w1": {"quant_algo": "FP8"},
        }
    )
    with pytest.raises(ValueError, match="Mixed quant_algo within fused layer model.layers.1.mlp.experts"):
        cfg.resolve("model.layers.1.mlp.experts")


def test_mixed_validation() -> None:
    with pytest.raises(ValueError, match="quantized_layers: MIXED_PRECISION needs a non-empty map"):
        _mixed({})
    with pytest.raises(ValueError, match=r"quantized_layers\['a'\].quant_algo: unsupported .*'INT8'"):
        _mixed({"a": {"quant_algo": "INT8"}})
    with pytest.raises(ValueError, match=r"quantized_layers\['a'\]: expected an object"):
        _mixed({"a": "NVFP4"})
    # group_size comes from the first NVFP4 entry; a wrong one is refused
    with pytest.raises(ValueError, match="NVFP4 blocks are 16 elements, got 32"):
        _mixed({"a": {"quant_algo": "FP8_PB_WO"}, "b": {"quant_algo": "NVFP4", "group_size": 32}})


def test_name_variants() -> None:
    v = name_variants("language_model.model.layers.2.block_sparse_moe.experts.3.w1")
    assert v[0] == "language_model.model.layers.2.block_sparse_moe.experts.3.w1"
    for want in (
        "model.layers.2.block_sparse_moe.experts.3.w1",
        "layers.2.block_sparse_moe.experts.3.w1",
        "model.language_model.layers.2.mlp.experts.3.w1",
        "layers.2.mlp.experts.3.w1",
    ):
        assert want in v
    assert len(set(v)) == len(v)
    assert "lm_head" in name_variants("language_model.lm_head")
    # only whole path components are swapped
    assert all("mlp_x" in n for n in name_variants("model.mlp_x.fc"))


def _write(d: Path, name: str, data: dict) -> None:
    (d / name).write_text(json.dumps(data))


def test_load_from_directory(tmp_path: Path) -> None:
    assert load_quant_config(tmp_path) is None
    _write(tmp_path, "config.json", {"model_type": "llama"})
    assert load_quant_config(tmp_path) is None
    _write(tmp_path, HF_QUANT_CONFIG, LEGACY_NVFP4)
    assert load_quant_config(tmp_path).quant_algo == "NVFP4"  # type: ignore[union-attr]
    _write(tmp_path, "config.json", {"text_config": {"quantization_config": FLAT_FP8_PB_WO}})
    assert load_quant_config(tmp_path).quant_algo == "FP8_PB_WO"  # type: ignore[union-attr]
    _write(tmp_path, "config.json", {"quantization_config": FLAT_NVFP4, "text_config": {}})
    assert load_quant_config(tmp_path).quant_algo == "NVFP4"  # type: ignore[union-attr]
    assert load_quant_config({"quantization_config": FLAT_FP8_PB_WO}).quant_algo == "FP8_PB_WO"  # type: ignore[union-attr]


def test_hf_quant_config_producer_must_be_modelopt(tmp_path: Path) -> None:
    _write(tmp_path, HF_QUANT_CONFIG, LEGACY_NVFP4 | {"producer": {"name": "someone-else"}})
    with pytest.raises(ValueError, match="producer.name must be 'modelopt', got 'someone-else'"):
        load_quant_config(tmp_path)


def test_mixed_config_json_without_layers_reads_hf_quant_config(tmp_path: Path) -> None:
    flat = {
        "quant_method": "modelopt_mixed",
        "quant_algo": "MIXED_PRECISION",
        "ignore": [],
        "producer": PRODUCER,
    }
    _write(tmp_path, "config.json", {"quantization_config": flat})
    with pytest.raises(ValueError, match="hf_quant_config.json: missing"):
        load_quant_config(tmp_path)
    with pytest.raises(ValueError, match="pass the checkpoint directory"):
        load_quant_config({"quantization_config": flat})
    layers = {"model.layers.0.mlp.experts.0.w1": {"quant_algo": "NVFP4", "group_size": 16}}
    legacy = {
        "producer": PRODUCER,
        "quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers},
    }
    _write(tmp_path, HF_QUANT_CONFIG, legacy)
    cfg = load_quant_config(tmp_path)
    assert cfg is not None and cfg.resolve("model.layers.0.mlp.experts.0.w1") == QuantAlgo.NVFP4
    _write(tmp_path, HF_QUANT_CONFIG, legacy | {"producer": {"name": "other"}})
    with pytest.raises(ValueError, match="producer.name must be 'modelopt'"):
        load_quant_config(tmp_path)
    # with quantized_layers present, config.json alone is enough
    _write(tmp_path, "config.json", {"quantization_config": flat | {"quantized_layers": layers}})
    assert load_quant_config(tmp_path).quantized_layers == {  # type: ignore[union-attr]
        "model.layers.0.mlp.experts.0.w1": QuantAlgo.NVFP4
    }


def test_non_modelopt_checkpoint_is_refused(tmp_path: Path) -> None:
    _write(tmp_path, "config.json", {"text_config": {"quantization_config": {"quant_method": "mxfp4"}}})
    with pytest.raises(ValueError, match="quant_method: expected modelopt.*'mxfp4'"):
        load_quant_config(tmp_path)
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        load_quant_config(tmp_path)


def test_substring_rule_matches_naive_search() -> None:
    """The trie regex behind the substring rule agrees with `any(x in name)` on random overlapping words
    (letters x/y only, so no root or mlp spelling of the name can add a match)."""
    gen = torch.Generator().manual_seed(0)

    def word(n: int, alphabet: str) -> str:
        idx = torch.randint(0, len(alphabet), (n,), generator=gen).tolist()
        return "".join(alphabet[i] for i in idx)

    entries = [word(int(torch.randint(3, 7, (1,), generator=gen)), "xy") for _ in range(12)]
    cfg = parse_quant_config(FLAT_FP8_PB_WO | {"ignore": entries})
    names = [word(int(torch.randint(3, 10, (1,), generator=gen)), "xy.") for _ in range(300)]
    hits = 0
    for name in names:
        want = any(e in name for e in entries)
        assert cfg.is_excluded(name) == want, (name, entries)
        hits += want
    assert 60 < hits < 240, hits  # both outcomes well represented


REAL = Path(__file__).resolve().parents[1] / "fixtures" / "real_checkpoints"


def test_bank_excluded_by_its_experts_names() -> None:
    """k3run's exporter lists each kept-bf16 expert projection; the bank resolves from all of them (a bank
    runs under one scheme), and naming only some of its experts is refused."""
    bank = "language_model.model.layers.1.block_sparse_moe.experts"
    every = [f"{bank}.{e}.{w}" for e in range(4) for w in ("w1", "w2", "w3")]
    cfg = parse_quant_config(FLAT_FP8_PB_WO | {"ignore": every})
    # the model asks in its own naming; inspect asks per expert projection, in the checkpoint's
    assert cfg.resolve("model.layers.1.mlp.experts", num_experts=4) == QuantAlgo.NONE
    assert cfg.resolve(f"{bank}.2.w3", num_experts=4) == QuantAlgo.NONE
    assert cfg.resolve("model.layers.2.mlp.experts", num_experts=4) == QuantAlgo.FP8_PB_WO
    # a fifth expert the list does not name
    with pytest.raises(ValueError, match=r"experts: exclude_modules covers 12 of the 15 .*expert 4 w1"):
        cfg.resolve("model.layers.1.mlp.experts", num_experts=5)
    some = parse_quant_config(FLAT_FP8_PB_WO | {"ignore": every[:-1]})
    with pytest.raises(ValueError, match=r"covers 11 of the 12 routed-expert projections .*expert 3 w3"):
        some.resolve("model.layers.1.mlp.experts", num_experts=4)
    # the bank by its own name, or a glob over its experts
    for ignore in ([bank], ["*block_sparse_moe.experts*"], ["*.experts.*"]):
        c = parse_quant_config(FLAT_FP8_PB_WO | {"ignore": ignore})
        assert c.resolve("model.layers.1.mlp.experts", num_experts=4) == QuantAlgo.NONE, ignore
    # transformers-5 names of the same experts
    t5 = [
        f"model.layers.1.mlp.experts.{e}.{w}" for e in range(4) for w in ("gate_proj", "up_proj", "down_proj")
    ]
    c = parse_quant_config(FLAT_FP8_PB_WO | {"ignore": t5})
    assert c.resolve("model.layers.1.mlp.experts", num_experts=4) == QuantAlgo.NONE


def test_transformers5_forget_gate_keys_resolve_for_the_model_names() -> None:
    """transformers 5 nests f_a_proj / f_b_proj under self_attn.forget_gate; the model asks for its fused
    in_proj with the original shard names."""
    pb = {"quant_algo": "FP8_PB_WO"}
    attn = "language_model.model.layers.0.self_attn"
    layers = {f"{attn}.{p}": pb for p in ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj")}
    layers |= {f"{attn}.forget_gate.f_a_proj": pb, f"{attn}.forget_gate.f_b_proj": pb}
    cfg = _mixed(layers)
    shards = tuple(
        f"model.layers.0.self_attn.{p}"
        for p in ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj")
    )
    assert cfg.resolve("model.layers.0.self_attn.in_proj", shards) == QuantAlgo.FP8_PB_WO
    assert cfg.resolve("model.layers.0.self_attn.f_b_proj") == QuantAlgo.FP8_PB_WO
    ex = parse_quant_config(FLAT_FP8_PB_WO | {"ignore": ["model.layers.0.self_attn.forget_gate.f_b_proj"]})
    assert ex.resolve("model.layers.0.self_attn.f_b_proj") == QuantAlgo.NONE


def test_published_nvfp4_k3_configs_resolve_banks() -> None:
    """nvidia/Kimi-K3-NVFP4 keys its NVFP4 entries by expert bank; an expert projection (what inspect sees
    in the headers) and the bank (what the model builds) resolve alike, from either config file."""
    hf = json.loads((REAL / "nvidia-Kimi-K3-NVFP4.config.json").read_text())
    flat = load_quant_config(hf)
    legacy = parse_quant_config(json.loads((REAL / "nvidia-Kimi-K3-NVFP4.hf_quant_config.json").read_text()))
    lm = "language_model.model.layers"
    for cfg in (flat, legacy):
        assert cfg is not None and cfg.quant_algo == "MIXED_PRECISION"
        for i in (1, 47, 92):
            assert cfg.resolve(f"model.layers.{i}.mlp.experts", num_experts=896) == QuantAlgo.NVFP4
            for w in ("w1", "w2", "w3"):
                assert cfg.resolve(f"{lm}.{i}.block_sparse_moe.experts.895.{w}", num_experts=896) == "NVFP4"
        for p in ("q_proj", "f_a_proj", "f_b_proj", "g_proj", "o_proj"):
            assert cfg.resolve(f"{lm}.0.self_attn.{p}") == QuantAlgo.FP8_PB_WO, p
        assert cfg.resolve(f"{lm}.3.self_attn.kv_b_proj") == QuantAlgo.FP8_PB_WO
        for p in ("mlp.gate_proj", "block_sparse_moe.gate", "block_sparse_moe.shared_experts.up_proj"):
            assert cfg.resolve(f"{lm}.{0 if p.startswith('mlp') else 5}.{p}") == QuantAlgo.NONE, p
        assert cfg.resolve(f"{lm}.5.block_sparse_moe.routed_expert_down_proj") == QuantAlgo.NONE
        assert cfg.resolve("language_model.lm_head") == QuantAlgo.NONE
