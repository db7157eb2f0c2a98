"""Bench scripts under test: `bench/*.py` are scripts, not a package; a test loads one by path."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def load_script(name: str) -> Iterator[ModuleType]:
    """`bench/<name>.py` as a module, registered in `sys.modules` while it is used (dataclasses
    look their module up while a class is made), removed after; for a module-scoped fixture."""
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", BENCH_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]
