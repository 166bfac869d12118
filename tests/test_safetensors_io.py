from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from k3run.safetensors_io import (
    INDEX_FILE,
    CheckpointError,
    CheckpointReader,
    checkpoint_files,
    dtype_code,
    iter_tensors,
    read_checkpoint_headers,
    read_header,
    torch_dtype,
)


def _tensors() -> dict[str, torch.Tensor]:
    return {
        "a.weight": torch.randn(3, 5, dtype=torch.bfloat16),
        "a.weight_scale": torch.rand(3, 1).to(torch.float8_e4m3fn),
        "b.scale": torch.tensor(0.25, dtype=torch.float32),
        "c.packed": torch.randint(0, 256, (4, 2), dtype=torch.uint8),
    }


def _write_raw(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_header_matches_tensors_without_loading(tmp_path: Path) -> None:
    ts = _tensors()
    f = tmp_path / "m.safetensors"
    save_file(ts, str(f), metadata={"format": "pt"})
    h = read_header(f)
    assert h.metadata == {"format": "pt"}
    assert set(h.tensors) == set(ts)
    for name, t in ts.items():
        info = h.tensors[name]
        assert info.shape == tuple(t.shape)
        assert info.torch_dtype == t.dtype
        assert info.nbytes == t.numel() * t.element_size()
        assert info.numel == t.numel()
    assert h.tensors["b.scale"].shape == ()


def test_reader_roundtrip_bit_exact(tmp_path: Path) -> None:
    ts = _tensors()
    save_file(ts, str(tmp_path / "model.safetensors"))
    with CheckpointReader(tmp_path) as r:
        for name, t in ts.items():
            got = r.get(name)
            assert got.dtype == t.dtype
            assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
        with pytest.raises(KeyError, match="nope"):
            r.get("nope")
    got = dict(iter_tensors(tmp_path, names=["b.scale"]))
    assert list(got) == ["b.scale"] and got["b.scale"].item() == 0.25


def test_index_shards_and_consistency(tmp_path: Path) -> None:
    ts = _tensors()
    names = sorted(ts)
    s1 = {n: ts[n] for n in names[:2]}
    s2 = {n: ts[n] for n in names[2:]}
    save_file(s1, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(s2, str(tmp_path / "model-00002-of-00002.safetensors"))
    wm = {n: "model-00001-of-00002.safetensors" for n in s1}
    wm |= {n: "model-00002-of-00002.safetensors" for n in s2}
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    assert [p.name for p in checkpoint_files(tmp_path)] == sorted(set(wm.values()))
    infos = read_checkpoint_headers(tmp_path)
    assert {n: i.file.name for n, i in infos.items()} == wm
    assert {n for n, _ in iter_tensors(tmp_path)} == set(ts)

    wrong = dict(wm)
    wrong[names[0]] = "model-00002-of-00002.safetensors"
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": wrong}))
    with pytest.raises(CheckpointError, match=f"{names[0]}.*stored in model-00001"):
        read_checkpoint_headers(tmp_path)

    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": wm | {"ghost.weight": wm[names[0]]}}))
    with pytest.raises(CheckpointError, match="ghost.weight.*no shard holds it"):
        read_checkpoint_headers(tmp_path)

    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {"x": "missing.safetensors"}}))
    with pytest.raises(CheckpointError, match="missing.safetensors"):
        checkpoint_files(tmp_path)


def test_model_safetensors_preferred_over_stray_files(tmp_path: Path) -> None:
    save_file({"x": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    save_file({"x": torch.zeros(2)}, str(tmp_path / "source.safetensors"))
    assert checkpoint_files(tmp_path) == [tmp_path / "model.safetensors"]
    (tmp_path / "model.safetensors").unlink()
    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(CheckpointError, match="'x' appears in both"):
        read_checkpoint_headers(tmp_path)


def test_truncated_file_names_first_cut_tensor(tmp_path: Path) -> None:
    f = tmp_path / "m.safetensors"
    save_file({"first": torch.ones(64), "second": torch.ones(64)}, str(f))
    raw = f.read_bytes()
    f.write_bytes(raw[:-10])
    with pytest.raises(CheckpointError, match="truncated: tensor 'second'"):
        read_header(f)
    f.write_bytes(raw[:5])
    with pytest.raises(CheckpointError, match="truncated: 5 bytes"):
        read_header(f)
    f.write_bytes(raw[:20])
    with pytest.raises(CheckpointError, match="truncated: header needs"):
        read_header(f)


def test_corrupt_headers(tmp_path: Path) -> None:
    f = tmp_path / "m.safetensors"
    raw = b"{not json"
    f.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(CheckpointError, match="not valid UTF-8 JSON"):
        read_header(f)
    f.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(CheckpointError, match="exceeds"):
        read_header(f)
    _write_raw(f, {"t": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 6]}}, b"\0" * 8)
    with pytest.raises(CheckpointError, match="hold 6 bytes, expected 8"):
        read_header(f)
    _write_raw(f, {"t": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 2)
    with pytest.raises(CheckpointError, match="unsupported dtype 'Q7'"):
        read_header(f)
    _write_raw(f, {"t": {"dtype": "U8", "shape": [2]}}, b"\0" * 2)
    with pytest.raises(CheckpointError, match="'t'.*lacks data_offsets"):
        read_header(f)
    _write_raw(
        f,
        {
            "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
            "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
        },
        b"\0" * 6,
    )
    with pytest.raises(CheckpointError, match="overlap"):
        read_header(f)


def test_dtype_codes_roundtrip() -> None:
    for code in ("BF16", "F32", "F8_E4M3", "U8", "F8_E8M0"):
        assert dtype_code(torch_dtype(code)) == code
    with pytest.raises(CheckpointError, match="complex64"):
        dtype_code(torch.complex64)
