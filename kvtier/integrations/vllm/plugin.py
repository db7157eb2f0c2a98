"""vLLM's plugin hook: makes `KVTierConnector` a connector name vLLM knows, with no module path.

Installed as an entry point in the `vllm.general_plugins` group (`pyproject.toml`), which vLLM
loads in each of its processes (API server, engine core, workers) before it builds a connector,
so that `--kv-transfer-config '{"kv_connector":"KVTierConnector","kv_role":"kv_both"}'` works.
Registration is lazy (a module path and a class name): a vLLM server that does not use kvtier
imports nothing of kvtier beyond this module. The long form, with `kv_connector_module_path`,
keeps working: vLLM takes a module path before its registry.
"""

from __future__ import annotations

import logging

CONNECTOR_NAME = "KVTierConnector"
CONNECTOR_MODULE = "kvtier.integrations.vllm.connector"

log = logging.getLogger(__name__)


def register() -> None:
    """Registers the connector under `CONNECTOR_NAME` with vLLM's connector factory. Idempotent;
    leaves a name another package registered first as it is (logged), and never raises: vLLM
    calls every general plugin in every process, kvtier used or not."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError as e:  # a vLLM without the factory: nothing to register with
        log.warning("kvtier: vLLM's KV connector factory is not importable (%s); use "
                    "kv_connector_module_path=%r instead", e, CONNECTOR_MODULE)
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:  # already registered: by an earlier load of this plugin, or by someone else
        try:
            registered = KVConnectorFactory.get_connector_class_by_name(CONNECTOR_NAME)
        except Exception as e:  # their loader failed: say so, and leave it to them
            log.warning("kvtier: the connector name %s is registered to something that does not load: %s",
                        CONNECTOR_NAME, e)
            return
        if registered.__module__ != CONNECTOR_MODULE:
            log.warning("kvtier: the connector name %s is taken by %s.%s; use kv_connector_module_path=%r "
                        "to reach kvtier's", CONNECTOR_NAME, registered.__module__, registered.__name__,
                        CONNECTOR_MODULE)
