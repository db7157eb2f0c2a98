"""Ports of child servers, known without a check-then-bind race (tests, benches and trials; Linux).

The race: a port found free by binding and closing a probe socket can be taken by anyone before the
child binds it, and a readiness probe that only connects then talks to that other process as if it
were ours. Two ways out, in order of preference:

- the child binds port 0 itself and `listening()` reads the port it got from /proc (`vllm serve
  --port 0`);
- a child that cannot take port 0 (`mooncake_master` reads 0 as its default, `redis-server` as "no
  TCP") is started on picked ports by `start_on_picked_ports()`, which counts it ready only once the
  child's own process holds a listening socket on each one, and starts it again on fresh ports if
  it lost one.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

POLL_S = 0.05  # /proc is read, not waited on: nothing signals that a child has bound its socket


def listening(pid: int) -> set[tuple[str, int]]:
    """The (address, port) pairs on which process `pid` itself holds a listening TCP socket.

    An address of "0.0.0.0" or "::" means every address. Empty when the process is gone.
    """
    inodes = _socket_inodes(pid)
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state == "0A" and inode in inodes:  # 0A: TCP_LISTEN
                address, port = local.split(":")
                found.add((_address(address, family), int(port, 16)))
    return found


def listens_on(pid: int, port: int, host: str = "127.0.0.1") -> bool:
    """Whether process `pid` itself listens on `host:port` (or on that port at every address)."""
    return any(p == port and a in (host, "0.0.0.0", "::") for a, p in listening(pid))


def wait_listening(proc: subprocess.Popen, host: str, timeout_s: float, *, count: int = 1) -> list[int]:
    """Waits until `proc` listens on `count` ports at `host`; returns them, lowest first.

    Raises:
        RuntimeError: the child exited, or held fewer than `count` listening ports within `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        ports = sorted(p for a, p in listening(proc.pid) if a in (host, "0.0.0.0", "::"))
        if len(ports) >= count:
            return ports
        if proc.poll() is not None:
            raise RuntimeError(f"pid {proc.pid} exited with status {proc.returncode} before it listened on {host}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"pid {proc.pid} listened on {ports} at {host}, not {count} port(s), "
                               f"after {timeout_s:.0f} s")
        time.sleep(POLL_S)


def start_on_picked_ports(start: Callable[[Sequence[int]], subprocess.Popen], count: int, *,
                          host: str = "127.0.0.1", timeout_s: float = 30.0,
                          attempts: int = 3) -> tuple[subprocess.Popen, list[int]]:
    """Starts a child that must be given its ports: `start(ports)` with `count` distinct ports picked
    here, ready once the child itself listens on every one of them.

    A child that lost a port to another process exits (or never listens on it); it is stopped and
    started again on fresh ports, up to `attempts` times.

    Raises:
        RuntimeError: every attempt failed (the last reason named), or the child did not listen on its
            ports within `timeout_s`.
    """
    reason = ""
    for _ in range(attempts):
        ports = _pick(count, host)
        proc = start(ports)
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None and time.monotonic() < deadline:
            if all(listens_on(proc.pid, p, host) for p in ports):
                return proc, ports
            if any(_taken_by_another(proc.pid, p, host) for p in ports):
                break
            time.sleep(POLL_S)
        status = proc.poll()
        stop(proc)
        if status is None and time.monotonic() >= deadline:
            raise RuntimeError(f"pid {proc.pid} did not listen on {host}:{ports} within {timeout_s:.0f} s")
        reason = (f"exited with status {status}" if status is not None else "another process took a port")
    raise RuntimeError(f"no attempt out of {attempts} came up on its ports: the last {reason}")


def stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s`; waits for the exit either way."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace_s)


def _pick(count: int, host: str) -> list[int]:
    """`count` distinct ports free at this instant: candidates only, checked again by the caller."""
    probes = [socket.socket() for _ in range(count)]
    try:
        for s in probes:
            s.bind((host, 0))  # all held at once, so they are distinct
        return [s.getsockname()[1] for s in probes]
    finally:
        for s in probes:
            s.close()


def _taken_by_another(pid: int, port: int, host: str) -> bool:
    """Whether something other than `pid` accepts connections on `host:port`."""
    if listens_on(pid, port, host):
        return False
    try:
        socket.create_connection((host, port), timeout=0.2).close()
    except OSError:
        return False
    return not listens_on(pid, port, host)  # bound between the two looks: ours after all


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _address(hex_address: str, family: int) -> str:
    raw = bytes.fromhex(hex_address)
    # /proc prints each 32-bit word in host order (little-endian here)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, words)
