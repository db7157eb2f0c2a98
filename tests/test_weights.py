"""Weights fingerprints (`kvtier.model.weights`): of weight files on disk and of tensors in memory.

Real files under tmp_path (safetensors, torch zip, an opaque format, a sparse multi-GB file), a
Hugging Face cache laid out on disk the way huggingface_hub writes it (nothing is downloaded).
Cost: ~5 s (most of it one subprocess importing torch).
"""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.model.weights import (
    ADAPTER_CONFIG_NAMES,
    WeightsSource,
    fingerprint_config,
    fingerprint_files,
    fingerprint_tensors,
    user_weights_id,
    weights_fingerprint,
)

safetensors_torch = pytest.importorskip("safetensors.torch")
DAY_S = 86_400


def tensors(seed: int, shapes=(("embed", (64, 64)), ("layer.w", (1024, 64)), ("norm", (64,)))) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes}


def checkpoint(directory: Path, weights: dict, config: dict | None = None) -> Path:
    """A model directory: model.safetensors, config.json and a tokenizer file (not weights)."""
    directory.mkdir(parents=True, exist_ok=True)
    safetensors_torch.save_file(weights, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(config or {"num_hidden_layers": 2}))
    (directory / "tokenizer.json").write_text("{}")
    return directory


def safetensors_header(path: Path) -> bytes:
    data = path.read_bytes()
    return data[: 8 + struct.unpack("<Q", data[:8])[0]]


def age(path: Path, seconds: int = DAY_S) -> None:
    """Backdates a file's mtime (its ctime stays now)."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - seconds * 10**9))


def test_retrained_weights_with_the_same_header_and_size_get_another_fingerprint(tmp_path):
    model = checkpoint(tmp_path / "m", tensors(0))
    first = fingerprint_files(model)
    assert first.startswith("files:") and fingerprint_files(model) == first
    header, size = safetensors_header(model / "model.safetensors"), (model / "model.safetensors").stat().st_size
    checkpoint(model, tensors(1))  # same architecture, other values: same header, same size
    assert safetensors_header(model / "model.safetensors") == header
    assert (model / "model.safetensors").stat().st_size == size
    assert fingerprint_files(model) != first
    checkpoint(model, tensors(0))
    assert fingerprint_files(model) == first


@pytest.mark.parametrize("name, index", [("norm", 0), ("embed", -1), ("layer.w", 512 * 64 + 3)])
def test_one_changed_tensor_value_changes_it(tmp_path, name, index):
    weights = tensors(0)
    model = checkpoint(tmp_path / "m", weights)
    before = fingerprint_files(model)
    weights[name].view(-1)[index] += 1.0  # the first, last or middle sample of one tensor
    checkpoint(model, weights)
    assert fingerprint_files(model) != before


def test_a_change_outside_every_sample_is_not_seen_so_weights_id_exists(tmp_path):
    weights = tensors(0)
    model = checkpoint(tmp_path / "m", weights)
    before = fingerprint_files(model)
    weights["layer.w"].view(-1)[1024 * 64 // 4] += 1.0  # a quarter into a 256 KiB tensor: unsampled
    checkpoint(model, weights)
    assert fingerprint_files(model) == before  # the documented limit: give weights_id then
    assert user_weights_id("ckpt-2", "weights_id") == "id:ckpt-2"


def test_only_a_new_mtime_keeps_the_fingerprint(tmp_path):
    model = checkpoint(tmp_path / "m", tensors(0))
    before = fingerprint_files(model)
    for path in model.iterdir():
        age(path)
    assert fingerprint_files(model) == before


def test_a_cached_digest_is_not_served_after_a_rewrite_that_restores_the_mtime(tmp_path):
    model = checkpoint(tmp_path / "m", tensors(0))
    weights = model / "model.safetensors"
    age(weights)
    mtime = weights.stat().st_mtime_ns
    before = fingerprint_files(model)  # old enough to be cached
    inode = weights.stat().st_ino
    with open(weights, "r+b") as f:  # in place: same inode and size, as `cp -p` over it
        f.seek(-4, os.SEEK_END)
        f.write(b"\x00\x00\x80\x3f")
    os.utime(weights, ns=(mtime, mtime))
    assert weights.stat().st_ino == inode and weights.stat().st_mtime_ns == mtime
    assert fingerprint_files(model) != before  # the ctime moved


def test_config_files_count_tokenizer_files_do_not(tmp_path):
    model = checkpoint(tmp_path / "m", tensors(0))
    before = fingerprint_files(model)
    (model / "tokenizer.json").write_text('{"added": 1}')
    assert fingerprint_files(model) == before
    checkpoint(model, tensors(0), {"num_hidden_layers": 2, "rope_theta": 500000.0})
    assert fingerprint_files(model) != before


def test_torch_zip_checkpoints_see_a_change_anywhere_in_a_tensor(tmp_path):
    weights = tensors(0)
    path = tmp_path / "pytorch_model.bin"
    torch.save(weights, path)
    before = fingerprint_files(path)
    weights["layer.w"].view(-1)[1024 * 64 // 4] += 1.0  # unsampled, but in the member's CRC-32
    torch.save(weights, path)
    assert fingerprint_files(path) != before


def test_other_formats_are_sampled_by_chunks(tmp_path):
    path = tmp_path / "model.gguf"
    data = bytearray(os.urandom(4 << 20))
    path.write_bytes(data)
    before = fingerprint_files(path)
    data[100] ^= 0xFF  # in the first 64 KiB
    path.write_bytes(data)
    assert fingerprint_files(path) != before


def sparse_safetensors(path: Path, num_tensors: int, tensor_bytes: int) -> None:
    """A valid safetensors file whose tensor data are holes: gigabytes that take no disk."""
    header, offset = {}, 0
    for i in range(num_tensors):
        header[f"t{i}"] = {"dtype": "BF16", "shape": [tensor_bytes // 2], "data_offsets": [offset, offset + tensor_bytes]}
        offset += tensor_bytes
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        f.truncate(8 + len(encoded) + offset)


def test_a_multi_gigabyte_file_costs_a_few_positioned_reads(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    sparse_safetensors(path, num_tensors=8, tensor_bytes=1 << 30)  # 8 GiB
    reads: list[int] = []
    pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: reads.append(n) or pread(fd, n, offset))
    assert fingerprint_files(path).startswith("files:")
    # The header twice (its length, then itself), then 3 samples per tensor, a tail joined to the next head.
    assert len(reads) <= 2 + 2 * 8 + 1 and sum(reads) <= 8 * 3 * 4096 + 2 * 4096


def test_a_hub_id_resolves_to_its_snapshot_in_the_local_cache(tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = checkpoint(repo / "snapshots" / commit, tensors(0))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    cache = str(tmp_path / "hub")
    expected = fingerprint_files(snapshot)
    assert weights_fingerprint(WeightsSource("org/tiny", cache_dir=cache)) == expected
    assert weights_fingerprint(WeightsSource("org/tiny", revision=commit, cache_dir=cache)) == expected


@pytest.mark.parametrize("model, revision", [("org/not-cached", "v1"), ("s3://bucket/model", None)])
def test_weights_that_cannot_be_read_fall_back_to_the_name_with_a_warning(tmp_path, caplog, model, revision):
    with caplog.at_level(logging.WARNING, logger="kvtier.model.weights"):
        got = weights_fingerprint(WeightsSource(model, revision, cache_dir=str(tmp_path / "hub")))
    assert got == f"name:{model}@{revision or ''}"
    assert len(caplog.records) == 1 and "set weights_id" in caplog.records[0].getMessage()


def test_a_directory_without_weight_files_falls_back_too(tmp_path, caplog):
    (tmp_path / "config.json").write_text("{}")
    assert fingerprint_files(tmp_path) is None
    with caplog.at_level(logging.WARNING, logger="kvtier.model.weights"):
        assert weights_fingerprint(WeightsSource(str(tmp_path))) == f"name:{tmp_path}@"
    assert "holds no weight files" in caplog.text


def test_a_user_weights_id_must_be_a_non_empty_string():
    assert user_weights_id(None, "weights_id") is None
    for bad in ("", " ", 3):
        with pytest.raises(ConfigError, match="extra.weights_id: expected a non-empty string"):
            user_weights_id(bad, "extra.weights_id")


def test_tensor_fingerprints_follow_values_dtypes_names_and_not_layout():
    base = tensors(0)
    first = fingerprint_tensors(base.items())
    assert first.startswith("params:") and fingerprint_tensors(tensors(0).items()) == first
    assert fingerprint_tensors(tensors(1).items()) != first
    changed = tensors(0)
    changed["layer.w"][-1, -1] += 1
    assert fingerprint_tensors(changed.items()) != first
    assert fingerprint_tensors({k: v.half() for k, v in base.items()}.items()) != first
    assert fingerprint_tensors({k + "_": v for k, v in base.items()}.items()) != first
    strided = {k: v.t().contiguous().t() if v.dim() == 2 else v for k, v in base.items()}  # same values, other strides
    assert fingerprint_tensors(strided.items()) == first
    with pytest.raises(ValueError, match="tensor w has no data here"):
        fingerprint_tensors([("w", torch.empty(4, device="meta"))])


def test_an_adapter_fingerprint_reads_its_adapter_config(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    safetensors_torch.save_file(tensors(0), adapter / "adapter_model.safetensors")
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    first = weights_fingerprint(WeightsSource(str(adapter)), ADAPTER_CONFIG_NAMES)
    base = weights_fingerprint(WeightsSource(str(adapter)))
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 32}))
    assert weights_fingerprint(WeightsSource(str(adapter)), ADAPTER_CONFIG_NAMES) != first, "alpha scales the update"
    assert weights_fingerprint(WeightsSource(str(adapter))) == base, "a base model's fingerprint reads no adapter config"


def test_config_fingerprints_follow_every_field_but_where_the_files_came_from():
    config = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "num_hidden_layers": 4,
              "text_config": {"_name_or_path": "/a", "head_dim": 16}, "_name_or_path": "/models/a",
              "transformers_version": "5.19.0", "torch_dtype": torch.float32}
    first = fingerprint_config(config)
    assert first.startswith("config:") and first == fingerprint_config(dict(reversed(list(config.items()))))
    moved = {**config, "_name_or_path": "/elsewhere", "_commit_hash": "abc",
             "text_config": {"head_dim": 16, "_name_or_path": "/b"}}
    assert fingerprint_config(moved) == first, "a path or a hub commit is not an identity"
    for changed in ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
                    {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}},
                    {"text_config": {"head_dim": 32}}, {"transformers_version": "5.20.0"},
                    {"torch_dtype": torch.float16}, {"use_cache": False}):
        assert fingerprint_config({**config, **changed}) != first, changed
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 16, 2) / 16)
    with_buffer = fingerprint_config(config, [("rotary_emb.inv_freq", inv_freq)])
    assert with_buffer != first and with_buffer == fingerprint_config(config, [("rotary_emb.inv_freq", inv_freq.clone())])
    assert fingerprint_config(config, [("rotary_emb.inv_freq", inv_freq / 4)]) != with_buffer
    with pytest.raises(ValueError, match="tensor b has no data here"):
        fingerprint_config(config, [("b", torch.empty(4, device="meta"))])
    with pytest.raises(ValueError, match="model config: cannot fingerprint it: .*torch.Tensor has no canonical"):
        fingerprint_config({**config, "scales": torch.zeros(4096)})  # its repr is abridged: never hashed


SCRIPT = """
import json, sys, torch
from kvtier.model.weights import fingerprint_files, fingerprint_tensors
gen = torch.Generator().manual_seed(0)
print(json.dumps([fingerprint_files(sys.argv[1]), fingerprint_tensors([("w", torch.randn(300, 30, generator=gen))])]))
"""


@pytest.mark.slow
def test_fingerprints_are_the_same_in_another_process(tmp_path):
    model = checkpoint(tmp_path / "m", tensors(0))
    env = os.environ | {"PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(model)], capture_output=True, text=True, env=env,
                         timeout=120, check=True)
    gen = torch.Generator().manual_seed(0)
    assert json.loads(out.stdout) == [fingerprint_files(model),
                                      fingerprint_tensors([("w", torch.randn(300, 30, generator=gen))])]
