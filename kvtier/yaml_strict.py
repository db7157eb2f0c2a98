"""YAML as kvtier reads it: PyYAML's safe loader, refusing a key given twice in one mapping.

PyYAML keeps the last of two equal keys without a word, so an edit that adds a setting already
present lower in the file silently does nothing (or undoes another edit). Here it is an error
naming the key and both lines.
"""

from __future__ import annotations

from typing import Any

import yaml


class _StrictLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:  # an unhashable key: the base class reports it
                break
            if first is not key_node:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"found the key {key!r} a second time (first at line {first.start_mark.line + 1}, "
                    f"column {first.start_mark.column + 1})",
                    key_node.start_mark)
        return super().construct_mapping(node, deep)


def load_yaml(text: str) -> Any:
    """Parses `text` like `yaml.safe_load`, but a mapping that repeats a key raises
    `yaml.YAMLError` (a `ConstructorError`) naming the key and where it first appeared."""
    return yaml.load(text, Loader=_StrictLoader)
