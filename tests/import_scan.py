"""Reading a module's imports from its syntax tree, for the checks that parse the package instead of
importing it (tests/launch/backends/test_layout.py, tests/launch/test_layers.py, tests/test_import_graph.py)."""

from __future__ import annotations

import ast


def runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:`` (imports for annotations never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            continue
        yield node
        yield from runtime_nodes(node)
