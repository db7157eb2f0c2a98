"""The package's layering, checked from its source: imports flow one way, nothing imports the test
doubles, no module-level cycles, and a bare import of the manager or the pool's two ends loads
neither YAML, torch, the config, nor any tool.

Layers, lowest first: core (every top-level module, `tiers`, `policy`, `pool`), then the engine
integrations (`integrations`), then the tools (`cli`, `sizing`, `simulate`, `demo`, `bench`).
`testing` (test doubles, contract suites) sits beside them all and only tests import it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvtier"
TOOLS = frozenset({"cli", "sizing", "simulate", "demo", "bench"})
RANK = {"core": 0, "integrations": 1, "tools": 2}


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) < 2 or parts[1] == "__main__":
        return "entry"  # `kvtier` and `python -m kvtier`: the entry point may import anything
    if parts[1] == "testing":
        return "testing"
    if parts[1] == "integrations":
        return "integrations"
    return "tools" if parts[1] in TOOLS else "core"


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def _imports(tree: ast.Module, top_level_only: bool) -> list[tuple[str, int]]:
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = []
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvtier":
            found += [(node.module, node.lineno)]
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "kvtier"]
    return found


MODULES = _modules()


def test_the_layout_is_the_one_described():
    assert {"kvtier.cli", "kvtier.sizing", "kvtier.simulate", "kvtier.demo", "kvtier.bench", "kvtier.testing",
            "kvtier.integrations.vllm", "kvtier.integrations.hf", "kvtier.integrations.sglang",
            "kvtier.pool.node", "kvtier.pool.client", "kvtier.units", "kvtier.kinds"} <= set(MODULES)
    # users' --kv-transfer-config and SGLang storage lines name the former modules: they still resolve
    assert {"kvtier.integrations.vllm_connector", "kvtier.integrations.sglang_storage"} <= set(MODULES)


def test_the_former_engine_paths_still_give_the_same_classes():
    pytest.importorskip("vllm")
    from kvtier.integrations.hf import HFKVTier
    from kvtier.integrations.hf.adapter import HFKVTier as moved
    from kvtier.integrations.vllm.connector import KVTierConnector
    from kvtier.integrations.vllm_connector import KVTierConnector as alias

    assert HFKVTier is moved and alias is KVTierConnector


def test_imports_flow_one_way_and_only_tests_import_the_test_doubles():
    wrong = []
    for module, tree in MODULES.items():
        mine = _layer(module)
        for target, line in _imports(tree, top_level_only=False):
            theirs = _layer(target)
            if mine == "entry" or theirs == "entry":
                continue
            if theirs == "testing" and mine != "testing":
                wrong.append(f"{module}:{line} imports the test double {target}")
            elif mine != "testing" and RANK[theirs] > RANK[mine]:
                wrong.append(f"{module}:{line} ({mine}) imports {target} ({theirs}), a layer above it")
    assert not wrong, "\n".join(wrong)


def test_no_module_level_import_cycle():
    graph = {m: {t for t, _ in _imports(tree, top_level_only=True) if t in MODULES and t != m}
             for m, tree in MODULES.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("module", ["kvtier.deciding.manager", "kvtier.pool.node.server", "kvtier.pool.client.api",
                                    "kvtier.units", "kvtier.kinds"])
def test_a_bare_import_loads_no_yaml_torch_config_or_tool(module):
    probe = (f"import sys, {module}\n"
             "heavy = {'yaml', 'torch', 'kvtier.config', 'kvtier.model.catalog'}\n"
             "tools = {'cli', 'sizing', 'simulate', 'demo', 'bench', 'integrations', 'testing'}\n"
             "print(sorted(m for m in sys.modules if m in heavy or m.split('.')[0] == 'kvtier'"
             " and len(m.split('.')) > 1 and m.split('.')[1] in tools))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert run.stdout.strip() == "[]", f"{module} loads {run.stdout.strip()}"


def test_the_public_api_is_importable_from_kvtier_and_lazy():
    import kvtier
    from kvtier.errors import TierIOError
    from kvtier.model.keys import block_keys
    from kvtier.runtime import KVTier

    assert kvtier.KVTier is KVTier and kvtier.block_keys is block_keys and kvtier.TierIOError is TierIOError
    assert set(kvtier.__all__) <= set(dir(kvtier))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        kvtier.nope  # noqa: B018
    probe = "import sys, kvtier; print(sorted(m for m in ('torch', 'yaml', 'kvtier.runtime') if m in sys.modules))"
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert run.stdout.strip() == "[]"
