"""YAML as hf_zero reads recipes and profiles: yaml.safe_load's values, with aliases bounded.

An alias (`*name`) makes the loaded value share the anchored node, so a few nested aliases ("billion laughs": each
level a list of nine aliases to the level before) load instantly into a small graph of shared objects that every
later walk expands: a 1.2 KB recipe took `hf-zero check` past 4 GB (writing the settings into summary.json,
copying them per stage). The composed document is measured before any value is built: how many values it holds
once every alias is expanded. A real recipe or profile holds a few hundred; past _MAX_VALUES (or an alias that
contains itself) it is refused in one line naming the file.
"""

from __future__ import annotations

import yaml

from hf_zero.core.errors import UserError

__all__ = ["load_yaml", "MAX_VALUES"]

MAX_VALUES = 100_000  # values of a document with its aliases expanded; the shipped recipes hold under 200


class _Expands(Exception):
    pass


def _expanded_size(root, limit: int) -> int:
    """Values under `root` counting each alias as a full copy, without expanding any: each node's size once."""
    sizes: dict[int, int] = {}
    visiting: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if key in sizes:
            continue
        children = node.value if isinstance(node, yaml.SequenceNode) else \
            [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else []
        if not children_done:
            if key in visiting:  # `&a [*a]`: a value that contains itself never ends when expanded
                raise _Expands("an alias that contains itself")
            visiting.add(key)
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in sizes)
            continue
        visiting.discard(key)
        sizes[key] = 1 + sum(sizes[id(c)] for c in children)
        if sizes[key] > limit:
            raise _Expands(f"aliases that expand to more than {limit:,} values")
    return sizes[id(root)]


def load_yaml(text: str, field: str, limit: int = MAX_VALUES):
    """The document's value as yaml.safe_load gives it; UserError(field, ...) when its aliases expand past `limit`
    values. yaml.YAMLError for text that is not YAML, as yaml.safe_load raises it (callers locate it)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        try:
            _expanded_size(node, limit)
        except _Expands as err:
            raise UserError(field, f"holds {err} (nested YAML anchors and aliases)",
                            "write the values out instead of aliasing them") from None
        return loader.construct_document(node)
    finally:
        loader.dispose()
