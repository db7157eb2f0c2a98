"""`kvtier size`: the real command in a subprocess, and its pure `size_report`.

The planner's arithmetic is tested by hand in tests/sizing/test_planner.py; here the command line end to end.
Cost: about a second per subprocess test (each starts `python -m kvtier` once); the plot test imports
matplotlib and writes one PNG under tmp_path.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.model.catalog import resolve_model
from kvtier.cli.size import format_bytes, size_report
from kvtier.errors import ConfigError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
REPO_ROOT = Path(__file__).resolve().parents[2]


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


def test_column_headers_name_what_they_count_and_its_unit():
    out = kvtier_size(*SEED, "--hbm", "24GiB")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.replace("┃", " ").split())  # rich wraps headers over lines
    assert "blocks × 8" not in text  # the old header over a byte count
    for header in ("context (tokens)", "KV / sequence", "KV, 8 sequences", "16-token blocks / sequence",
                   "bytes in blocks, 8 sequences", "size (binary units)", "KV per server", "link GB/s",
                   "time for 4,096 tokens"):
        assert all(word in text for word in header.split()), header
    headers = _header_cells(out.stdout, "context")
    assert headers == ["context (tokens)", "KV / sequence", "KV, 8 sequences", "16-token blocks / sequence",
                       "bytes in blocks, 8 sequences"]


def _header_cells(stdout: str, first: str) -> list[str]:
    """The column headers of the table whose first header starts with `first`, rejoined across lines."""
    lines = stdout.splitlines()
    for top, line in enumerate(lines):
        if line.startswith("┏"):
            rows = []
            for header_line in lines[top + 1:]:
                if header_line.startswith("┡"):
                    break
                rows.append([cell.strip() for cell in header_line.strip("┃").split("┃")])
            cells = [" ".join(filter(None, column)) for column in zip(*rows)]
            if cells and cells[0].startswith(first):
                return cells
    raise AssertionError(f"no table starting with {first!r}")


@pytest.mark.parametrize(
    ("typed", "canonical"),
    [("meta-llama/Llama-3.1-8B-Instruct", "Llama-3.1-8B"), ("qwen3-8b-instruct", "Qwen3-8B"),
     ("Qwen/Qwen3-8B", "Qwen3-8B"), ("google/gemma-3-27b-it", "Gemma-3-27B")],
)  # fmt: skip
def test_a_name_that_is_not_the_catalogs_prints_what_it_matched(typed, canonical):
    out = kvtier_size("--model", typed, "--context", "4096")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == f"model: {typed} matched as {canonical}"
    assert f"{canonical}:" in out.stdout


def test_the_catalogs_own_name_prints_no_match_line_and_json_stays_clean():
    for name in ("Llama-3.1-8B", "llama-3.1-8b"):  # the catalog's name, in any case
        out = kvtier_size("--model", name, "--context", "4096")
        assert out.returncode == 0, out.stderr
        assert "matched as" not in out.stdout
    json_out = kvtier_size("--model", "meta-llama/Llama-3.1-8B-Instruct", "--context", "4096", "--json")
    assert json_out.returncode == 0, json_out.stderr
    report = json.loads(json_out.stdout)  # the line goes to stderr
    assert (report["model"], report["model_requested"]) == ("Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct")
    assert "model: meta-llama/Llama-3.1-8B-Instruct matched as Llama-3.1-8B" in json_out.stderr
    assert "model_requested" not in size_json("--model", "Llama-3.1-8B", "--context", "4096")


def test_unknown_model_exits_2_with_a_clear_message():
    out = kvtier_size("--model", "llama-2-8b", "--context", "4096")
    assert out.returncode == 2
    assert "unknown model 'llama-2-8b'" in out.stderr
    assert "Llama-2-7B" in out.stderr
    assert "Traceback" not in out.stderr


def test_unknown_newer_model_suggests_close_names():
    out = kvtier_size("--model", "Qwen/Qwen3-9B", "--context", "4096")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "unknown model 'Qwen/Qwen3-9B' (did you mean Qwen3-8B" in out.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--context", "0"], "context: must be a positive integer"),
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


# --- the planner from the command line --------------------------------------------------------

SEED = ("--model", "llama-2-7b", "--context", "4096", "--concurrency", "8")


def test_seed_example_on_a_24_gb_card_json():
    # RTX 4090: 24,564 MiB; reserve floor(10%); weights 2 x 6,738,415,616 bytes.
    report = size_json(*SEED, "--gpu", "RTX-4090-24")
    hbm_bytes = 24564 * MiB
    reserve = hbm_bytes // 10
    assert report["kv_bytes_per_token"] == 512 * KiB and report["kv_bytes_total"] == 16 * GiB  # old keys hold
    assert report["weights"]["bytes"] == 13_476_831_232
    hbm = report["hbm"]
    assert (hbm["hbm_bytes"], hbm["reserve_bytes"]) == (hbm_bytes, reserve)
    assert hbm["fits"] is False
    assert hbm["overflow_bytes"] == 16 * GiB - (hbm_bytes - 13_476_831_232 - reserve) == 7_475_201_638
    assert report["tiers"]["per_server"]["dram_bytes"] == 7_475_201_638


def test_seed_example_table_says_it_does_not_fit():
    out = kvtier_size(*SEED, "--hbm", "24GiB")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # rich wraps long lines
    for expected in ("DOES NOT FIT in HBM", "13.48 GB", "KV 16 GiB", "6.95 GiB of KV per GPU (43%) must overflow",
                     "it fits at tensor-parallel 2", "Where the KV lives", "PCIe-Gen4-x16"):
        assert expected in text, expected


def test_a_cluster_plan_with_a_distribution_and_capacities():
    report = size_json("--model", "llama-3-70b", "--context-dist", "p50=4k,p90=32k,max=128k", "--concurrency", "32",
                       "--gpu", "H100-80", "--tp", "4", "--gpus-per-server", "8", "--servers", "4",
                       "--dram", "8GiB", "--pool", "16GiB", "--ttft-target", "500ms")  # fmt: skip
    assert report["workload"]["source"] == "distribution"
    assert report["kv_bytes_total"] == 32 * (2048 * 5 + 18432 * 4 + 81920) * 320 * KiB // 10  # exact
    assert report["parallel"]["replicas_per_server"] == 2 and report["parallel"]["num_replicas"] == 8
    tiers = report["tiers"]
    overflow = tiers["overflow_bytes_per_server"]
    assert overflow == 2 * 4 * report["hbm"]["overflow_bytes"]  # 2 replicas x 4 GPUs' shares
    assert tiers["per_server"]["dram_bytes"] == 8 * GiB
    assert tiers["cluster"]["pool_bytes"] == 16 * GiB
    assert tiers["cluster"]["ssd_bytes"] == 4 * (overflow - 8 * GiB) - 16 * GiB
    assert report["reload"]["ttft_target_s"] == 0.5


def test_context_trace_draws_from_input_lengths(tmp_path):
    lines = [{"timestamp": 0, "input_length": n, "output_length": 1, "hash_ids": list(range(-(-n // 512)))}
             for n in (100, 200, 200, 400)]  # fmt: skip
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(line) for line in lines))
    report = size_json("--model", "tiny", "--context-trace", str(trace), "--concurrency", "2")
    assert report["kv_bytes_total"] == 450 * 512
    assert [c["label"] for c in report["contexts"]] == ["p50", "p90", "p99", "max"]


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "plan.png"
    out = kvtier_size(*SEED, "--hbm", "24GiB", "--dram", "4GiB", "--pool", "1GiB", "--plot", str(path))
    assert out.returncode == 0, out.stderr
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_weights_are_optional_without_a_gpu(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}))
    assert "weights" not in size_json("--model", str(path), "--context", "16")
    out = kvtier_size("--model", str(path), "--context", "16", "--hbm", "1GiB")
    assert out.returncode == 2 and "vocab_size" in out.stderr and "--params" in out.stderr
    assert size_json("--model", str(path), "--context", "16", "--hbm", "1GiB", "--params", "1M")["hbm"]["fits"]


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--gpu", "A100"], "unknown GPU 'A100' (did you mean A100-40 or A100-80?)"),
     (["--gpu", "H100-90"], "did you mean H100-80"),
     (["--tp", "3"], "tensor-parallel degree 3 does not divide its 32 attention heads"),
     (["--hbm", "24XB"], "hbm: cannot read '24XB'"),
     (["--hbm", "24GiB", "--reserve", "1.5"], "reserve must be a fraction in [0, 1)"),
     (["--tp", "2", "--gpus-per-server", "3"], "must be a multiple of tensor_parallel"),
     (["--ttft-target", "0s"], "ttft_target must be positive"),
     (["--weight-dtype", "int3"], "unknown weight_dtype 'int3'")],
)  # fmt: skip
def test_bad_planner_input_exits_2(args, message):
    out = kvtier_size("--model", "llama-2-7b", "--context", "4k", *args)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_bad_distribution_exits_2():
    out = kvtier_size("--model", "tiny", "--context-dist", "p50=4k,p90=32k")
    assert out.returncode == 2 and "give max=" in out.stderr
