"""kvtier.testing.ports: a child's ports come from the child, and a squatter on a picked port is never
taken for it."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from kvtier.testing import ports

# A child that binds what it is told (port 0 included), prints the port it got, and serves until killed.
CHILD = r"""
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError as e:
    sys.exit(f"bind: {e}")
s.listen(4)
print(s.getsockname()[1], flush=True)
time.sleep(600)
"""


def _child(port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)


def test_listening_reads_the_port_the_child_bound_itself() -> None:
    proc = _child(0)
    try:
        reported = int(proc.stdout.readline())
        assert ports.wait_listening(proc, "127.0.0.1", 30) == [reported]
        assert ports.listens_on(proc.pid, reported)
        assert not ports.listens_on(proc.pid, reported, host="127.0.0.2")
    finally:
        ports.stop(proc)
    assert ports.listening(proc.pid) == set()  # gone: nothing, not an error


def test_a_socket_of_this_process_is_not_the_childs() -> None:
    with socket.socket() as mine:
        mine.bind(("127.0.0.1", 0))
        mine.listen(1)
        proc = _child(0)
        try:
            proc.stdout.readline()
            assert not ports.listens_on(proc.pid, mine.getsockname()[1])
        finally:
            ports.stop(proc)


def test_a_child_that_exits_before_listening_is_an_error_naming_it() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match=rf"pid {proc.pid} exited with status 3 before it listened"):
        ports.wait_listening(proc, "127.0.0.1", 30)


def test_picked_ports_are_distinct_and_held_by_the_child() -> None:
    started = []

    def start(picked):
        started.append(list(picked))
        return _child(picked[0])

    proc, got = ports.start_on_picked_ports(start, 1)
    try:
        assert got == started[-1] and ports.listens_on(proc.pid, got[0])
    finally:
        ports.stop(proc)
    assert len(set(ports._pick(8, "127.0.0.1"))) == 8


def test_a_squatter_on_the_picked_port_means_fresh_ports_never_the_squatter(monkeypatch) -> None:
    """The race the module exists for, forced: something else listens on the picked port first. The
    child loses the bind and exits; it is never counted ready on the squatter's socket (a probe that
    only connected would have been), and the next attempt runs on fresh ports."""
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(4)
    taken = squatter.getsockname()[1]
    picks = iter([[taken], None])
    real_pick = ports._pick
    monkeypatch.setattr(ports, "_pick", lambda n, host: next(picks) or real_pick(n, host))
    tried = []

    def start(picked):
        tried.append(picked[0])
        return _child(picked[0])

    try:
        proc, got = ports.start_on_picked_ports(start, 1)
        try:
            assert tried[0] == taken and got[0] != taken and len(tried) == 2
            assert ports.listens_on(proc.pid, got[0])
        finally:
            ports.stop(proc)
    finally:
        squatter.close()


def test_every_attempt_lost_is_an_error(monkeypatch) -> None:
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(4)
    monkeypatch.setattr(ports, "_pick", lambda n, host: [squatter.getsockname()[1]])
    try:
        with pytest.raises(RuntimeError, match="no attempt out of 2 came up on its ports"):
            ports.start_on_picked_ports(lambda picked: _child(picked[0]), 1, attempts=2)
    finally:
        squatter.close()
