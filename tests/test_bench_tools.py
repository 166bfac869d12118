"""The benchmark tooling that builds models stays runnable: bench/k3_shaped.py's random K3-shaped model (at
tiny widths here) quantizes as the k3-mixed recipe does and decodes through the engine on CPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

from k3run.engine import LLM, EngineConfig, SamplingParams
from k3run.quant.algo import QuantAlgo
from k3run.tokenizer import load_tokenizer

ROOT = Path(__file__).parents[1]


def bench_module(name: str, root: Path = ROOT) -> ModuleType:
    """bench/<name>.py imported by its path (bench/ is a folder of scripts, not a package; nothing is added
    to sys.path), once per process."""
    key = f"k3run_bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, root / "bench" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


# vocab 2056 is the bundled tokenizer's (2048 BPE tokens, the chat markers, reserved ids): the engine checks
# that the model's vocabulary holds every tokenizer id
TINY = dict(vocab_size=2056, hidden_size=256, num_heads=2, q_lora_rank=128, moe_intermediate_size=128,
            routed_expert_hidden_size=128, top_k=2)  # fmt: skip


def test_random_k3_shaped_model_is_k3_mixed_and_decodes() -> None:
    model = bench_module("k3_shaped").random_k3_model(layers=4, experts=8, device="cpu", dims=TINY)
    kinds = [type(layer.self_attn).__name__ for layer in model.layers]
    assert kinds == ["KimiDeltaAttention"] * 3 + ["KimiMLA"]
    assert model.layers[0].self_attn.in_proj.scheme.algo is QuantAlgo.FP8_PB_WO
    assert model.layers[3].mlp.experts.algo is QuantAlgo.NVFP4
    assert all(torch.isfinite(p.float()).all() for p in model.parameters() if p.dtype != torch.uint8)
    llm = LLM.from_model(model, load_tokenizer(ROOT / "assets" / "default-model-k3-mixed"),
                         EngineConfig(max_num_seqs=2, max_model_len=32))  # fmt: skip
    out = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [4, 4]


def _tp_decode(tp, root: str) -> list[list[int]]:
    model = bench_module("k3_shaped", Path(root)).random_k3_model(
        layers=4, experts=8, device="cpu", dims=TINY, tp=tp
    )
    assert model.layers[0].self_attn.tp.size == 2
    llm = LLM.from_model(model, load_tokenizer(Path(root) / "assets" / "default-model-k3-mixed"),
                         EngineConfig(max_num_seqs=2, max_model_len=32, tp_size=2))  # fmt: skip
    out = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in out]


def test_random_k3_shaped_model_shards_over_tensor_parallel_ranks() -> None:
    """The K3-shaped model built as one rank's shard (probe_graph_step.py under torchrun): two gloo ranks
    build and decode it through the engine with tp_size 2 and emit the same tokens."""
    from tests.gloo import spawn_gloo

    ranks = spawn_gloo(_tp_decode, 2, str(ROOT))
    assert ranks[0] == ranks[1] and [len(t) for t in ranks[0]] == [4, 4]


def _writer() -> ModuleType:
    return bench_module("write_kimi_linear")


def test_kimi_linear_tensor_table_expands_to_the_published_checkpoint() -> None:
    """bench/write_kimi_linear.py's 35 name patterns give exactly the published tensor and parameter counts
    of moonshotai/Kimi-Linear-48B-A3B-Instruct (20,493 tensors, 49,122,681,728 parameters)."""
    import json
    import math

    w = _writer()
    table = json.loads((ROOT / "bench" / "configs" / "kimi_linear_48b_a3b.tensor-table.json").read_text())
    tensors = w.expand(table)
    assert len(tensors) == table["tensor_count"] == 20493
    assert sum(math.prod(s) for s, _ in tensors.values()) == table["param_count"]
    assert tensors["model.layers.26.block_sparse_moe.experts.255.w2.weight"] == ((2304, 1024), "BF16")


def test_written_kimi_linear_slice_loads_with_every_check(tmp_path, monkeypatch) -> None:
    """The writer at real widths, cut to 4 layers (3 KDA, 1 MLA), 4 experts and a 1024-token vocabulary,
    quantized as ModelOpt NVFP4 to disk: k3run loads it through every checkpoint check and its logits are
    finite and of unit scale (the writer's N(0, 1/K) weights)."""
    from k3run.api import load_model
    from k3run.forward_context import ForwardContext

    w = _writer()
    dst = tmp_path / "kl"
    args = [str(dst), "--layers", "4", "--experts", "4", "--vocab", "1024", "--device", "cpu"]
    monkeypatch.setattr(sys, "argv", ["write_kimi_linear.py", *args])
    w.main()
    model = load_model(dst, dtype=torch.float32, device="cpu")
    assert [type(layer.self_attn).__name__ for layer in model.layers] == ["KimiDeltaAttention"] * 3 + [
        "KimiMLA"
    ]
    assert model.layers[1].mlp.experts.algo is QuantAlgo.NVFP4
    logits = model.compute_logits(model(torch.tensor([1, 2, 3, 4, 5]), ForwardContext.single(5)))
    assert bool(torch.isfinite(logits).all()) and 0.3 < float(logits.std()) < 3.0


def test_probe_configs_parse_knob_settings_per_engine(monkeypatch) -> None:
    """probe_graph_step --configs: ';'-separated K3RUN_ settings, each parsed by the knobs' own parsers on top
    of the process's environment ('' is the shipped settings); a malformed word stops the probe."""
    import pytest

    probe = bench_module("probe_graph_step")
    monkeypatch.setenv("K3RUN_MOE_ROUTER_PARTIALS", "24")
    assert probe._configs("") == [(None, {})]
    (l1, c1), (l2, c2) = probe._configs("K3RUN_MLA_ABSORB_KERNELS=32 K3RUN_KDA_FB_SIDE=1; ")
    assert l1 == "K3RUN_MLA_ABSORB_KERNELS=32 K3RUN_KDA_FB_SIDE=1" and l2 == ""
    assert c1["mla_absorb_kernels"] == 32 and c1["kda_fb_side"] is True and c1["moe_router_partials"] == 24
    assert c2["mla_absorb_kernels"] == 64 and c2["kda_fb_side"] is False and c2["moe_router_partials"] == 24
    with pytest.raises(SystemExit, match="K3RUN_NAME=value"):
        probe._configs("MLA=1")
    with pytest.raises(ValueError, match="K3RUN_MLA_ABSORB_KERNELS"):
        probe._configs("K3RUN_MLA_ABSORB_KERNELS=999")


def test_profile_charges_each_running_instant_to_the_kernel_that_ends_first() -> None:
    """probe_graph_step's 'advance' column: a PDL successor started under its predecessor is charged from the
    predecessor's end; of two overlapping streams the one ending first holds the overlap; the charges sum to
    the busy time (a gap between kernels is nobody's)."""
    probe = bench_module("probe_graph_step")
    spans = [(0.0, 10.0, "gemv"), (4.0, 13.0, "norm"), (13.0, 20.0, "gemv"), (30.0, 36.0, "kda"),
             (31.0, 33.0, "side"), (35.0, 40.0, "gemv")]  # fmt: skip
    adv = probe._advance(spans)
    assert adv == {"gemv": 10.0 + 7.0 + 4.0, "norm": 3.0, "kda": 1.0 + 3.0, "side": 2.0}
    busy, _ = probe._busy([(s, e) for s, e, _ in spans])
    assert sum(adv.values()) == busy == 30.0
    # the idle: 30 - 20 after the second gemv, before kda; nothing else (the norm starts under the gemv)
    assert probe._gaps(spans) == {("gemv", "kda"): (10.0, 1)}
    # the kernel that ends last holds the idle, not the one that started last
    assert probe._gaps([(0.0, 9.0, "a"), (1.0, 3.0, "b"), (12.0, 13.0, "c"), (15.0, 16.0, "c")]) == {
        ("a", "c"): (3.0, 1),
        ("c", "c"): (2.0, 1),
    }


def test_smi_sampler_windows_and_rotating_calls(monkeypatch) -> None:
    """bench/common.SmiSampler: without nvidia-smi it samples nothing (every window None, close a no-op); a
    window gives the medians of the samples stamped inside it (clock, power), the hottest temperature and the
    distinct clock-event reasons (`held_text`: 'MHz / W' for a table). `rotating` calls the functions in
    turn."""
    import shutil

    common = bench_module("common")
    monkeypatch.setattr(shutil, "which", lambda _: None)
    s = common.SmiSampler()
    assert s.proc is None and s.window(0.0, 1e9) is None
    s.close()
    s.samples = [(1.0, 1980.0, 300.0, 50.0, "0x0"), (2.0, 1500.0, 690.0, 58.0, "0x4"),
                 (3.0, 1400.0, 700.0, 57.0, "0x4"), (9.0, 900.0, 100.0, 40.0, "0x0")]  # fmt: skip
    w = s.window(1.5, 3.5)
    assert w == {"mhz": 1450.0, "watts": 695.0, "temp_c": 58.0, "reasons": ["0x4"], "n": 2}
    assert s.window(4.0, 8.0) is None
    assert common.held_text(w) == "1450 / 695" and common.held_text(None) == "-"
    calls: list[int] = []
    f = common.rotating([lambda: calls.append(0), lambda: calls.append(1)])
    for _ in range(5):
        f()
    assert calls == [0, 1, 0, 1, 0]


def test_module_profile_charges_each_kernel_to_every_module_around_its_launch() -> None:
    """probe_graph_step --modules: a kernel goes, through its correlation id, to the launch call's CPU time
    and from there to every label range holding it (nested ranges: the family and its submodule both); a
    kernel whose launch is outside every range, or has no launch event, is reported as charged to none."""
    import pytest

    probe = bench_module("probe_graph_step")
    ranges = [(0.0, 100.0, "KDA"), (10.0, 20.0, "KDA.in_proj"), (30.0, 40.0, "KDA.o_proj"),
              (100.0, 150.0, "moe"), (110.0, 120.0, "moe.gate")]  # fmt: skip
    launches = {1: 12.0, 2: 25.0, 3: 35.0, 4: 115.0, 5: 160.0, 6: 100.0}
    kernels = [(1, 4.0), (2, 1.0), (3, 3.0), (4, 2.0), (5, 7.0), (6, 0.5), (99, 9.0)]
    charged, counted, lost = probe._charge(ranges, launches, kernels)
    assert dict(charged) == {"KDA": 8.0, "KDA.in_proj": 4.0, "KDA.o_proj": 3.0, "moe": 2.5, "moe.gate": 2.0}
    assert dict(counted) == {"KDA": 3, "KDA.in_proj": 1, "KDA.o_proj": 1, "moe": 2, "moe.gate": 1}
    assert lost == (16.0, 2)  # id 5 launched after every range, id 99 with no launch event
    # nested random ranges (layers of modules of submodules) against the definition, range by range
    import random

    rng = random.Random(0)
    ranges = []
    for layer in range(20):
        a = layer * 100.0
        ranges.append((a, a + 90.0, f"L{layer % 3}"))
        for j in range(3):
            b = a + 5.0 + 28.0 * j
            ranges.append((b, b + 20.0, f"L{layer % 3}.m{j}"))
    launches = {i: rng.uniform(-10.0, 2010.0) for i in range(400)}
    kernels = [(i, rng.uniform(0.5, 9.0)) for i in range(420)]  # ids 400..419: no launch event
    charged, counted, (lost_us, lost_n) = probe._charge(ranges, launches, kernels)
    want: dict = {}
    for c, us in kernels:
        labels = {lab for a, b, lab in ranges if c in launches and a <= launches[c] < b}
        for lab in labels or {None}:
            want[lab] = want.get(lab, 0.0) + us
    assert lost_us == pytest.approx(want.pop(None)) and set(charged) == set(want)
    assert all(charged[lab] == pytest.approx(want[lab]) for lab in want) and sum(counted.values()) > 400


def test_launch_table_groups_kernels_by_name_and_grid(tmp_path, capsys) -> None:
    """probe_graph_step --trace: the exported Chrome trace's kernels grouped by (name, grid), per step (two
    grids of one kernel stay apart; CPU events and other categories are not kernels), the trace kept
    gzipped."""
    import gzip
    import json

    probe = bench_module("probe_graph_step")
    kernels = [("gemv", [54, 1, 1], 48.0), ("gemv", [54, 1, 1], 50.0), ("gemv", [144, 3, 1], 10.0),
               ("norm", [8, 1, 1], 2.0)] * 2  # fmt: skip
    events = [{"cat": "kernel", "name": n, "dur": d, "args": {"grid": g}} for n, g, d in kernels]
    events.append({"cat": "cpu_op", "name": "aten::mm", "dur": 999.0, "args": {}})

    class Prof:
        def export_chrome_trace(self, path: str) -> None:
            with open(path, "w") as f:
                json.dump({"traceEvents": events}, f)

    probe._launch_table(Prof(), 8, 2, str(tmp_path))
    rows = [r.split() for r in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[0], r[-3:]) for r in rows] == [
        ("gemv", ["2.0", "49.0", "98.0"]), ("gemv", ["1.0", "10.0", "10.0"]), ("norm", ["1.0", "2.0", "2.0"]),
    ]  # fmt: skip
    with gzip.open(tmp_path / "trace_b8.json.gz") as f:
        assert len(json.load(f)["traceEvents"]) == len(events)
    assert not (tmp_path / "trace_b8.json").exists()


def test_tcache_prune_keeps_what_a_cache_hit_loads(tmp_path) -> None:
    """bench/tcache_prune.py on a copy of a cache: a kernel group keeps its metadata json and cubin (named by
    the original cache's paths), its IR files are deleted from the copy; a group without a cubin stays."""
    import json

    tool = bench_module("tcache_prune")
    kernel, stub = tmp_path / "AAA", tmp_path / "BBB"
    kernel.mkdir()
    stub.mkdir()
    names = ["k.json", "k.cubin", "k.ttir", "k.ptx"]
    for n in names:
        (kernel / n).write_text(n)
    (stub / "s.so").write_text("so")
    original = {n: f"/tmp/original/AAA/{n}" for n in names}  # the paths the group was written with
    (kernel / "__grp__k.json").write_text(json.dumps({"child_paths": original}))
    (stub / "__grp__s.json").write_text(json.dumps({"child_paths": {"s.so": "/tmp/original/BBB/s.so"}}))
    assert tool.prune(str(tmp_path)) == (1, 2)
    assert sorted(p.name for p in kernel.iterdir()) == ["__grp__k.json", "k.cubin", "k.json"]
    group = json.loads((kernel / "__grp__k.json").read_text())["child_paths"]
    assert group == {"k.json": original["k.json"], "k.cubin": original["k.cubin"]}
    assert (stub / "s.so").exists() and "s.so" in (stub / "__grp__s.json").read_text()
