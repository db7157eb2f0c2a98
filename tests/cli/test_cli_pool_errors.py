"""`kvtier pool serve` and `kvtier pool stats` on bad flags and an unreachable node: exit 2 and one
line naming the flag or the address. In process through `kvtier.cli.main`; no node is started.
Cost: well under a second.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator

import pytest

from kvtier.cli import main


@pytest.fixture(autouse=True)
def root_handlers() -> Iterator[None]:
    """`pool serve` configures logging onto this test's captured stderr; later tests must not log there."""
    before = list(logging.root.handlers)
    yield
    logging.root.handlers[:] = before


@pytest.fixture
def refused_address() -> Iterator[str]:
    """HOST:PORT of a bound socket that never listens: a connection there is refused, and no other
    process can take the port while the test runs."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def error_line(capsys: pytest.CaptureFixture[str]) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("capacity, message", [
    ("0B", "--capacity: 0B is not a positive size"),
    ("0", "--capacity: 0 is not a positive size"),
    ("1KiB", "--capacity: 1KiB is below the smallest region, 4 KiB"),
])
def test_serve_names_capacity_for_a_capacity_too_small(capsys, capacity: str, message: str) -> None:
    assert main(["pool", "serve", "--listen", "127.0.0.1:0", "--capacity", capacity, "--transport", "tcp"]) == 2
    line = error_line(capsys)
    assert line == f"kvtier pool: error: {message}" and "--region-size" not in line


def test_serve_still_names_region_size_for_a_bad_region(capsys) -> None:
    assert main(["pool", "serve", "--listen", "127.0.0.1:0", "--capacity", "1MiB", "--region-size", "1KiB",
                 "--transport", "tcp"]) == 2
    assert error_line(capsys).startswith("kvtier pool: error: --region-size: ")


def test_stats_names_a_missing_secret_file_once(capsys, refused_address: str, tmp_path) -> None:
    missing = tmp_path / "nope"
    assert main(["pool", "stats", refused_address, "--secret-file", str(missing)]) == 2
    assert error_line(capsys) == f"kvtier pool: error: --secret-file: {missing}: No such file or directory"


def test_stats_on_an_unreachable_node_exits_2_naming_it(capsys, refused_address: str) -> None:
    assert main(["pool", "stats", refused_address, "--timeout-s", "5"]) == 2
    line = error_line(capsys)
    assert line.startswith(f"kvtier pool stats: pool node {refused_address}: "), line


def test_stats_with_a_readable_secret_file_goes_on_to_the_node(tmp_path, refused_address: str, capsys) -> None:
    key = tmp_path / "key"
    key.write_text("  s3cret\n")
    assert main(["pool", "stats", refused_address, "--secret-file", str(key)]) == 2
    assert "--secret-file" not in error_line(capsys)
