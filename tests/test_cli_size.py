"""`kvtier size`: the real command in a subprocess, and its pure `size_report`.

Cost: a few seconds; each subprocess test starts `python -m kvtier` once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.catalog import resolve_model
from kvtier.cli_size import format_bytes, size_report
from kvtier.errors import ConfigError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
REPO_ROOT = Path(__file__).resolve().parents[1]


def kvtier_size(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvtier", "size", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def size_json(*args: str) -> dict:
    out = kvtier_size(*args, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_llama2_7b_json():
    report = size_json("--model", "llama-2-7b", "--context", "4096", "--concurrency", "8")
    assert report["kv_bytes_per_token"] == 512 * KiB
    assert report["kv_bytes_total"] == 16 * GiB
    assert report["contexts"][0]["kv_bytes_per_sequence"] == 2 * GiB


def test_qwen25_7b_several_contexts():
    report = size_json("--model", "Qwen/Qwen2.5-7B-Instruct", "--context", "1024", "8192", "32768")
    assert report["kv_bytes_per_token"] == 56 * KiB
    assert [c["kv_bytes_total"] // MiB for c in report["contexts"]] == [56, 448, 1792]
    assert report["kv_bytes_total"] == 2296 * MiB


@pytest.mark.parametrize(("kv_dtype", "total"), [("fp16", 32 * GiB), ("fp8", 16 * GiB), ("int8", 16 * GiB)])
def test_kv_dtype_flag(kv_dtype, total):
    report = size_json("--model", "llama-3-8b", "--context", "32768", "--concurrency", "8", "--kv-dtype", kv_dtype)
    assert report["kv_dtype"] == kv_dtype
    assert report["kv_bytes_total"] == total


def test_config_json_path_and_block_tokens(tmp_path):
    config = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "hidden_size": 4096, "torch_dtype": "float16"}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    report = size_json("--model", str(path), "--context", "1000", "--block-tokens", "256")
    assert report["kv_bytes_per_token"] == 128 * KiB
    assert report["block_bytes"] == 256 * 128 * KiB
    assert report["contexts"][0]["num_blocks_per_sequence"] == 3  # the partial 4th block is not cached


def test_table_output_is_readable():
    out = kvtier_size("--model", "llama-2-7b", "--context", "4096", "--concurrency", "8")
    assert out.returncode == 0, out.stderr
    for text in ("Llama-2-7B", "512 KiB", "16 GiB", "4,096"):
        assert text in out.stdout


def test_unknown_model_exits_2_with_a_clear_message():
    out = kvtier_size("--model", "llama-2-8b", "--context", "4096")
    assert out.returncode == 2
    assert "unknown model 'llama-2-8b'" in out.stderr
    assert "Llama-2-7B" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--context", "0"], "context must be a positive integer"),
     (["--context", "16", "--concurrency", "-1"], "concurrency"),
     (["--context", "16", "--kv-dtype", "fp4"], "unknown kv_dtype 'fp4'")],
)  # fmt: skip
def test_bad_values_exit_2(args, message):
    out = kvtier_size("--model", "tiny", *args)
    assert out.returncode == 2
    assert message in out.stderr


# --- the pure report --------------------------------------------------------------------------


def test_sliding_report_separates_resident_kv_from_cached_blocks():
    model = resolve_model("mistral-7b")  # every layer slides over 4,096 tokens
    report = size_report(model, [32768], concurrency=2, block_tokens=16)
    context = report["contexts"][0]
    assert context["kv_bytes_per_sequence"] == 512 * MiB
    assert context["block_bytes_per_sequence"] == 4 * GiB  # blocks keep every token of every layer
    assert report["kv_bytes_total"] == 1 * GiB
    assert report["sliding_window_tokens"] == [4096]
    json.dumps(report)  # plain data


def test_mla_report_names_the_latent():
    report = size_report(resolve_model("deepseek-v3"), [1024], concurrency=1, block_tokens=64)
    assert report["kv_lora_rank"] == 512 and report["qk_rope_head_dim"] == 64
    assert report["kv_bytes_per_token_by_kind"] == {"mla": 61 * 576 * 2}


@pytest.mark.parametrize(
    ("contexts", "concurrency", "block_tokens", "field"),
    [([], 1, 16, "context"), ([16], 0, 16, "concurrency"), ([16], 1, 0, "block_tokens"), ([-5], 1, 16, "context")],
)
def test_report_rejects_non_positive_inputs(contexts, concurrency, block_tokens, field):
    with pytest.raises(ConfigError, match=field):
        size_report(resolve_model("tiny"), contexts, concurrency, block_tokens)


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [(0, "0 B"), (1023, "1,023 B"), (512 * KiB, "512 KiB"), (16 * GiB, "16 GiB"), (int(1.75 * GiB), "1.75 GiB"),
     (3 * 1024 * GiB, "3 TiB")],
)  # fmt: skip
def test_format_bytes(num_bytes, text):
    assert format_bytes(num_bytes) == text
