"""Pool nodes as real subprocesses (`kvtier pool serve` on 127.0.0.1), for the demo, the benches and tests.

Readiness is the node's own "ready" line on stdout followed by an answered STATS call: nothing
sleeps or guesses. Lines the node prints before it (`{"event": "metrics", "url": ...}` with
`--metrics-port`) are kept in `events`. A node can be stopped (SIGTERM), killed (SIGKILL), frozen
(SIGSTOP, the way a node hangs mid-transfer) and restarted on the same address.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvtier.pool.client.api import PoolClient

READY_TIMEOUT_S = 60.0  # a safety net against a node that never starts, never a measurement


class NodeProcess:
    """One `kvtier pool serve` subprocess."""

    def __init__(self, *, capacity: str = "64MiB", region_size: str = "1MiB", listen: str = "127.0.0.1:0",
                 tenants: str | Path | None = None, credentials: tuple[str, bytes] = ("default", b""),
                 extra: Sequence[str] = (), wait: bool = True) -> None:
        self._args = ["--capacity", capacity, "--region-size", region_size, *extra]
        if tenants is not None:
            self._args += ["--tenants", str(tenants)]
        self.address, self.credentials = listen, credentials
        # the verbs provider its clients need under RDMA: what `--verbs` names, pyverbs by default
        self.verbs = extra[list(extra).index("--verbs") + 1] if "--verbs" in extra else "pyverbs"
        self.ready: dict = {}
        self.events: dict[str, dict] = {}  # the node's start-up lines by event name ("metrics", "ready")
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile()
        if not wait:
            self.spawn()
            return
        try:
            self.start()
        except BaseException:
            self.close()  # a node that never became ready must not outlive the failed start
            raise

    def start(self) -> None:
        """Starts the node (again, on the same address once it had one) and waits until it serves.

        Raises:
            RuntimeError: the node exited or said nothing within READY_TIMEOUT_S; carries its stderr.
            Anything the readiness probe raises; the process is left to `close()`.
        """
        self.spawn()
        self.wait_ready()

    def spawn(self) -> None:
        """Starts the process without waiting; `wait_ready()` waits."""
        cmd = [sys.executable, "-m", "kvtier", "pool", "serve", "--listen", self.address, *self._args]
        # bufsize=0: readline takes one line from the pipe and no more, so a line already printed
        # is never stuck in Python's buffer while the selector waits on an empty pipe
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, bufsize=0,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_ready(self) -> None:
        """Waits for the ready line, then for an answered STATS call. Raises as `start`."""
        self.ready = self._read_ready()
        self.address = self.ready["listen"]
        tenant, secret = self.credentials
        with PoolClient([self.address], tenant=tenant, secret=secret, reconnect_s=0,
                        timeout_s=READY_TIMEOUT_S) as probe:
            probe.stats()

    @property
    def metrics_port(self) -> int | None:
        """The port of the node's metrics endpoint (`--metrics-port`), None without one."""
        url = self.events.get("metrics", {}).get("url")
        return int(url.rsplit(":", 1)[1].split("/")[0]) if url else None

    def _read_ready(self) -> dict:
        self.events = {}
        deadline = time.monotonic() + READY_TIMEOUT_S
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if sel.select(deadline - time.monotonic()):
                    line = self.proc.stdout.readline()
                    if not line:
                        break
                    event = json.loads(line)
                    self.events[event.get("event")] = event
                    if event.get("event") == "ready":
                        return event
        self.kill()
        raise RuntimeError(f"pool node did not start: {self.stderr()}")

    def stderr(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def terminate(self) -> int:
        """SIGTERM, then waits; returns the exit status."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(READY_TIMEOUT_S)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(READY_TIMEOUT_S)

    def pause(self) -> None:
        """Freezes the node, returning only once every thread of it has stopped (SIGSTOP alone is
        asynchronous: a request sent right after could still be served)."""
        self.proc.send_signal(signal.SIGSTOP)
        os.waitpid(self.proc.pid, os.WUNTRACED)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            try:
                self.terminate()
            except subprocess.TimeoutExpired:
                self.kill()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


def start_nodes(count: int, **kwargs) -> list[NodeProcess]:
    """`count` nodes started side by side (their start-ups overlap), each ready on return."""
    nodes = [NodeProcess(wait=False, **kwargs) for _ in range(count)]
    try:
        for node in nodes:
            node.wait_ready()
    except BaseException:
        for node in nodes:
            node.close()
        raise
    return nodes


@contextmanager
def running_node(**kwargs) -> Iterator[NodeProcess]:
    """A `NodeProcess` for the duration of the block; stopped (SIGTERM, then SIGKILL) afterwards."""
    node = NodeProcess(**kwargs)
    try:
        yield node
    finally:
        node.close()
