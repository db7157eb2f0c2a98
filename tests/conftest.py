"""What every test shares: the `gpu` and `rdma` marks applied once, here.

A test marked `gpu` runs only where torch sees a CUDA device, one marked `rdma` only where real
pyverbs opens an RDMA device; elsewhere each is skipped with the reason, never deleted. The
device probes run only when a collected test carries the mark.
"""

from __future__ import annotations

import pytest

from kvtier.testing.devices import has_cuda, has_rdma_device

_NEEDS = {"gpu": (has_cuda, "needs a CUDA device"),
          "rdma": (has_rdma_device, "no RDMA device on this host (see kvtier/pool/rxe_setup.sh)")}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for mark, (present, reason) in _NEEDS.items():
            if item.get_closest_marker(mark) is not None and not present():
                item.add_marker(pytest.mark.skip(reason=reason))


# ---- fixtures several test modules use (their helpers are plain imports from `support`) ----------

from support.hf import model, model_dir  # noqa: E402,F401 (a tiny Llama built once per module)
from support.pool import tenants_file  # noqa: E402,F401 (alice the operator, bob a tenant with a quota)
from support.runtime import ssd  # noqa: E402,F401 (an SSD tier in tmp_path)
from support.sglang import sgl  # noqa: E402,F401 (SGLang's modules from its wheel)
from support.vllm import pool_node, reference, tiny_model  # noqa: E402,F401 (vLLM's model, reference runs, a node)
from support.traces import conversation, synthetic  # noqa: E402,F401 (the shared Mooncake traces, once per module)
