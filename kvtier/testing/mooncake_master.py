"""A `mooncake_master` subprocess for tests, benches and trials, with every port chosen here."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path


def free_port(host: str) -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MasterProcess:
    """A `mooncake_master` subprocess on 127.0.0.1 with every port chosen here (tests, benches, trials).

    Serves RPC on `rpc_port`, the HTTP metadata server on `http_port`, metrics on `metrics_port`;
    ready once both RPC and HTTP accept connections.

    Raises:
        RuntimeError: the binary is missing, or the master did not come up within `timeout_s`.
    """

    def __init__(self, *, timeout_s: float = 30.0, log_path: Path | None = None, extra: Sequence[str] = ()) -> None:
        import sys

        binary = Path(sys.executable).parent / "mooncake_master"
        binary = str(binary) if binary.exists() else shutil.which("mooncake_master")
        if binary is None:
            raise RuntimeError("mooncake_master not found next to python nor on PATH")
        self.rpc_port, self.http_port, self.metrics_port = (free_port("127.0.0.1") for _ in range(3))
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen([
            binary, "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc_port}", "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={self.http_port}",
            "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}", "--enable_metric_reporting=false",
            *extra], stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        for port in (self.rpc_port, self.http_port):
            while not _accepts(port):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"mooncake_master did not come up on port {port} (exit {self.proc.poll()})")
                time.sleep(0.02)  # polling a port: there is nothing to wait on

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._log is not subprocess.DEVNULL:
            self._log.close()


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False
