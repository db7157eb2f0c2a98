"""kvtier's vLLM plugin: `"kv_connector":"KVTierConnector"` with no module path.

In a fresh interpreter started outside the checkout (as vLLM's processes are), the installed
distribution's `vllm.general_plugins` entry point is found, vLLM's own plugin loader runs it, and
vLLM's connector factory then resolves the bare name to kvtier's connector; the long form still
resolves. In process: registering twice is harmless, and a name another package took first is
left to it, with a warning naming the long form. (The real `vllm serve` with the short form:
tests/integrations/test_vllm_serve.py.)"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402

from kvtier.integrations.vllm import plugin  # noqa: E402

PROBE = """
import json
from importlib.metadata import entry_points
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.plugins import load_general_plugins

found = [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "kvtier"]
load_general_plugins()
short = KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_both"))
long = KVConnectorFactory.get_connector_class(KVTransferConfig(
    kv_connector="KVTierConnector", kv_role="kv_both", kv_connector_module_path="kvtier.integrations.vllm.connector"))
print(json.dumps({"entry_points": found, "short": f"{short.__module__}.{short.__name__}",
                  "long": f"{long.__module__}.{long.__name__}"}))
"""


def test_vllm_finds_the_connector_by_name_through_the_installed_entry_point(tmp_path):
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["entry_points"] == ["kvtier.integrations.vllm.plugin:register"]
    assert got["short"] == got["long"] == "kvtier.integrations.vllm.connector.KVTierConnector"


@pytest.fixture
def registry(monkeypatch):
    """vLLM's connector registry, emptied for the test and restored after it."""
    monkeypatch.setattr(KVConnectorFactory, "_registry", {})
    return KVConnectorFactory._registry


def test_registering_twice_is_harmless(registry, caplog):
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        plugin.register()
        plugin.register()
    cls = KVConnectorFactory.get_connector_class_by_name("KVTierConnector")
    assert (cls.__module__, cls.__name__) == ("kvtier.integrations.vllm.connector", "KVTierConnector")
    assert not caplog.records


def test_a_name_taken_by_another_package_is_left_to_it_with_a_warning(registry, caplog):
    KVConnectorFactory.register_connector("KVTierConnector", "vllm.distributed.kv_transfer.kv_connector.v1.base",
                                          "KVConnectorBase_V1")
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        plugin.register()
    assert KVConnectorFactory.get_connector_class_by_name("KVTierConnector").__name__ == "KVConnectorBase_V1"
    assert "kv_connector_module_path='kvtier.integrations.vllm.connector'" in caplog.text
    assert "is taken by" in caplog.text
