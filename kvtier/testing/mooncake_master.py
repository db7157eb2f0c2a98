"""A `mooncake_master` subprocess for tests, benches and trials, with every port chosen here."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from kvtier.testing.ports import start_on_picked_ports, stop


class MasterProcess:
    """A `mooncake_master` subprocess on 127.0.0.1 with every port chosen here (tests, benches, trials).

    Serves RPC on `rpc_port`, the HTTP metadata server on `http_port`, its admin/metrics server on
    `metrics_port`; ready once its own process listens on all three.

    Raises:
        RuntimeError: the binary is missing, or the master did not come up within `timeout_s`.
    """

    def __init__(self, *, timeout_s: float = 30.0, log_path: Path | None = None, extra: Sequence[str] = ()) -> None:
        import sys

        binary = Path(sys.executable).parent / "mooncake_master"
        binary = str(binary) if binary.exists() else shutil.which("mooncake_master")
        if binary is None:
            raise RuntimeError("mooncake_master not found next to python nor on PATH")
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL

        def start(ports: Sequence[int]) -> subprocess.Popen:
            rpc, http, metrics = ports
            return subprocess.Popen([
                binary, "--rpc_address=127.0.0.1", f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}",
                "--metrics_host=127.0.0.1", f"--metrics_port={metrics}", "--enable_metric_reporting=false",
                *extra], stdout=self._log, stderr=subprocess.STDOUT)

        # the master reads --rpc_port=0 as its default (50051): its ports are picked, and it is up once
        # its own process listens on all three (its HTTP metadata server binds 0.0.0.0 whatever the host)
        try:
            self.proc, ports = start_on_picked_ports(start, 3, timeout_s=timeout_s)
        except RuntimeError as e:
            self._close_log()
            raise RuntimeError(f"mooncake_master did not come up: {e}") from None
        self.rpc_port, self.http_port, self.metrics_port = ports

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def close(self) -> None:
        stop(self.proc)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not subprocess.DEVNULL:
            self._log.close()
