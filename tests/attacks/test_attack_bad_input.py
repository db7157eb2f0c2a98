"""Bad input that used to end in a traceback instead of an error naming the line or the field.

Attacks (a hostile or broken trace file, a typo'd capacity, a config written for a bigger
machine): a trace whose lines all list zero hash ids (ZeroDivisionError), a line of deeply nested
JSON (RecursionError, which `--on-error skip` could not skip), `--capacity dram=1e30` and friends
(OverflowError in the replay; `1e99999999999` expanded exactly, taking gigabytes and minutes), `--block-tokens` past
64 bits, and a DRAM tier or pool node larger than the machine's memory (a bare OSError ENOMEM).
Each now gets an error naming the line or the field: exit code 2 and one message from the CLI, a
CapacityError naming `tiers.dram.capacity` from the runtime. Allocations that could succeed under
overcommit run in a subprocess with RLIMIT_AS set, so a regression fails with ENOMEM instead of
waking the OOM killer. Cost: about 1 s, and 7 s more for the two `slow` children that import torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.errors import ConfigError
from kvtier.simulate.trace import OnError, TraceError, load_trace
from kvtier.units import parse_seconds, parse_size

TIMEOUT_S = 120  # a safety net for the subprocesses, never a measurement


def line(timestamp: int, input_length: int, hash_ids: list[int]) -> str:
    return json.dumps({"timestamp": timestamp, "input_length": input_length, "output_length": 1,
                       "hash_ids": hash_ids}) + "\n"


@pytest.fixture
def one_block_trace(tmp_path: Path) -> Path:
    path = tmp_path / "one.jsonl"
    path.write_text(line(0, 512, [1]) + line(1, 1024, [1, 2]))
    return path


def simulate(capsys, *args: str) -> tuple[int, str]:
    code = main(["simulate", "--no-progress", "--json", *args])
    return code, capsys.readouterr().err


def test_a_trace_whose_lines_list_no_hash_id_is_an_error_naming_the_file(tmp_path, capsys):
    path = tmp_path / "short.jsonl"
    path.write_text(line(0, 100, []) + line(1, 200, []))  # inputs under one block: valid lines, no block
    code, err = simulate(capsys, "--trace", str(path), "--capacity", "dram=10")
    assert code == 2 and str(path) in err and "no block to replay" in err
    with pytest.raises(TraceError, match="none of the 2 requests"):
        load_trace(path)


def test_a_deeply_nested_line_is_a_malformed_line_named_by_number_and_can_be_skipped(tmp_path, capsys):
    path = tmp_path / "deep.jsonl"
    path.write_text(line(0, 512, [1]) + "[" * 100_000 + "]" * 100_000 + "\n" + line(1, 512, [1]))
    code, err = simulate(capsys, "--trace", str(path), "--capacity", "dram=10")
    assert code == 2 and f"{path}: line 2: JSON nested too deeply" in err
    trace = load_trace(path, on_error=OnError.SKIP)
    assert len(trace.requests) == 2 and [n for n, _ in trace.skipped_lines] == [2]
    code, err = simulate(capsys, "--trace", str(path), "--capacity", "dram=10", "--on-error", "skip")
    assert code == 0 and "skipped 1 malformed line" in err


@pytest.mark.parametrize("capacity, says", [
    ("dram=1e30", "more than 9,223,372,036,854,775,807 bytes"),
    ("dram=1e30GiB", "more than 9,223,372,036,854,775,807 bytes"),
    ("dram=1e30%", "at most 2,147,483,646 can be replayed"),
    ("dram=1000000000000", "at most 2,147,483,646 can be replayed"),
    ("dram=9223372036854775808", "at most 2,147,483,646 can be replayed"),
    ("dram=1e999999", "exponent"),  # 1e99999999999 expanded exactly took gigabytes: kept small for a regression
])
def test_a_capacity_too_large_to_replay_is_an_error_naming_it(one_block_trace, capsys, capacity, says):
    code, err = simulate(capsys, "--trace", str(one_block_trace), "--capacity", capacity)
    assert code == 2 and "capacity dram" in err and says in err


def test_a_sweep_point_too_large_is_an_error_naming_the_option(one_block_trace, capsys):
    code, err = simulate(capsys, "--trace", str(one_block_trace), "--capacity", "dram=1", "--sweep",
                         "--sweep-points", "1e30,1")
    assert code == 2 and "sweep-points" in err


def test_block_tokens_past_the_replays_counters_is_an_error_naming_the_option(tmp_path, capsys):
    path = tmp_path / "ones.jsonl"
    path.write_text(line(0, 512, [1]) + line(1, 512, [1]))  # one id each: valid lines for any block size
    code, err = simulate(capsys, "--trace", str(path), "--capacity", "dram=10", "--block-tokens", str(2**70))
    assert code == 2 and "block-tokens" in err


def test_sizes_and_numbers_with_absurd_exponents_are_refused_at_once():
    with pytest.raises(ConfigError, match="tiers.ssd.capacity: the exponent"):
        parse_size("1e999999", "tiers.ssd.capacity")
    with pytest.raises(ConfigError, match="more than .* bytes"):
        parse_size("1e30", "tiers.ssd.capacity")
    with pytest.raises(ConfigError, match="more than .* bytes"):
        parse_size(2**64, "tiers.ssd.capacity")
    with pytest.raises(ConfigError, match="timeout: the exponent"):
        parse_seconds("1e-999999", "timeout")
    assert parse_size("1e18", "x") == 10**18 and parse_size(2**63 - 1, "x") == 2**63 - 1


def _under_rlimit_as(code: str, headroom_bytes: int) -> subprocess.CompletedProcess:
    """Runs `code` in a child whose address space may grow `headroom_bytes` past what it holds once
    torch and kvtier are imported: an allocation past that is ENOMEM, never the OOM killer."""
    prelude = textwrap.dedent(f"""
        import resource
        import torch  # noqa: F401  (imported before the limit: its own mappings are large)
        from kvtier.config import TierConfig
        from kvtier.kinds import TierKind
        from kvtier.tiers.build import build_tier
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + {headroom_bytes}, vm + {headroom_bytes}))
    """)
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=TIMEOUT_S)


@pytest.mark.slow  # a child that imports torch: ~3 s
def test_a_dram_tier_larger_than_the_machine_is_a_capacity_error_naming_the_field():
    from kvtier.tiers.host_memory import memory_limit

    limit = memory_limit()
    assert limit is not None, "kvtier reads the machine's memory from /proc/meminfo (Linux)"
    done = _under_rlimit_as(f"""
        try:
            build_tier(TierConfig(TierKind.DRAM, {2 * limit[0]}), 1 << 20)
        except Exception as e:
            print(type(e).__name__, e)
    """, 64 << 20)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("CapacityError tiers.dram.capacity:") and "more than" in done.stdout


@pytest.mark.slow  # a child that imports torch: ~3 s
def test_a_dram_tier_the_kernel_refuses_is_a_capacity_error_naming_the_field_not_a_bare_enomem():
    from kvtier.tiers.host_memory import memory_limit

    limit = memory_limit()
    assert limit is not None and limit[0] >= (1 << 30), f"a machine of at least 1 GiB whose memory is known: {limit}"
    done = _under_rlimit_as("""
        try:
            build_tier(TierConfig(TierKind.DRAM, 512 << 20), 1 << 20)  # within the machine, past the rlimit
        except Exception as e:
            print(type(e).__name__, e)
    """, 64 << 20)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("CapacityError tiers.dram.capacity:") and "Cannot allocate memory" in done.stdout


def _limit_to_2_gib() -> None:
    """In the node's child: an address space of 2 GiB (plenty for a node without torch), so a node
    that did map its capacity gets ENOMEM rather than the OOM killer's attention."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def test_a_pool_node_larger_than_the_machine_exits_2_naming_capacity():
    from kvtier.tiers.host_memory import memory_limit

    limit = memory_limit()
    assert limit is not None, "kvtier reads the machine's memory from /proc/meminfo (Linux)"
    cmd = [sys.executable, "-m", "kvtier", "pool", "serve", "--listen", "127.0.0.1:0",
           "--capacity", str(2 * limit[0] // 4096 * 4096)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, preexec_fn=_limit_to_2_gib)
    assert done.returncode == 2 and "--capacity" in done.stderr and "Traceback" not in done.stderr
