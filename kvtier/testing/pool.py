"""Pool nodes over the fake verbs NIC, for tests: the node and this process on one fake fabric."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvtier.pool.node.process import NodeProcess, running_node
from kvtier.testing.fake_verbs import ENV_FABRIC

FAKE_VERBS = "kvtier.testing.fake_verbs"  # the verbs provider to pass as `verbs=` (client, tier, node)


@contextmanager
def rdma_node(verbs: str = "fake", fabric: Path | str | None = None, **kwargs) -> Iterator[NodeProcess]:
    """A node serving `--transport rdma` on `verbs` for the duration of the block.

    Args:
        verbs: `fake` (the software NIC of `kvtier.testing.fake_verbs`) or `pyverbs` (a real device).
        fabric: with `fake`, the directory the fake fabric lives in, shared with the node.
        kwargs: as `NodeProcess`; `extra` gets `--transport rdma --verbs MODULE` added.
    Yields the node, whose `verbs` names the provider this process's clients must be given
    (`PoolClient(..., verbs=node.verbs)`). With `fake`, sets the fake's own `KVTIER_FAKE_FABRIC`
    in `os.environ` (the node inherits it) and puts back what was there afterwards.
    """
    if verbs not in ("fake", "pyverbs"):
        raise ValueError(f"rdma_node: verbs must be fake or pyverbs, got {verbs!r}")
    if verbs == "fake" and fabric is None:
        raise ValueError("rdma_node: the fake verbs need a fabric directory")
    provider = FAKE_VERBS if verbs == "fake" else "pyverbs"
    saved = os.environ.get(ENV_FABRIC)
    if fabric is not None:
        os.environ[ENV_FABRIC] = str(fabric)
    try:
        kwargs["extra"] = [*kwargs.get("extra", ()), "--transport", "rdma", "--verbs", provider]
        with running_node(**kwargs) as node:
            yield node
    finally:
        if saved is None:
            os.environ.pop(ENV_FABRIC, None)
        else:
            os.environ[ENV_FABRIC] = saved
