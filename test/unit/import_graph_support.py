"""The import graph of the ``lightllm`` package, read from the source with ``ast``.

Every ``import``/``from ... import`` counts, at module level or inside a function, including
``TYPE_CHECKING`` blocks: a lazy import is still a dependency a reader must follow.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

Edges = Dict[str, Set[str]]


def module_files(package_dir: Path) -> Dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``package_dir`` (packages by ``__init__``)."""
    root = package_dir.parent
    files: Dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def _targets(module: str, node: ast.AST, files: Dict[str, Path]) -> List[str]:
    names: List[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = module.split(".")
            if files[module].name != "__init__.py":
                package = package[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join(package + ([base] if base else []))
        # ``from pkg import submodule`` depends on the submodule, ``from mod import name`` on mod.
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
    resolved = []
    for name in names:
        while name and name not in files:
            name = name.rpartition(".")[0]
        if name and name != module:
            resolved.append(name)
    return resolved


def import_edges(package_dir: Path) -> Edges:
    """Module -> the package's own modules it imports."""
    files = module_files(package_dir)
    edges: Edges = defaultdict(set)
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            edges[module].update(_targets(module, node, files))
        edges[module]
    return edges


def strongly_connected(nodes: Iterable[str], edges: Edges) -> List[List[str]]:
    """Tarjan's components of size > 1 (the import circles), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    circles: List[List[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(nodes):
        if node not in index:
            visit(node)
    return circles


def room_edges(edges: Edges, folder: str) -> Tuple[Edges, Dict[Tuple[str, str], List[Tuple[str, str]]]]:
    """Edges between the direct children ("rooms") of ``folder``, and the imports behind each."""
    prefix = folder + "."

    def room(module: str) -> Optional[str]:
        return module[len(prefix):].split(".")[0] if module.startswith(prefix) else None

    rooms: Edges = defaultdict(set)
    behind: Dict[Tuple[str, str], List[Tuple[str, str]]] = defaultdict(list)
    for source, targets in edges.items():
        source_room = room(source)
        if source_room is None:
            continue
        rooms[source_room]
        for target in targets:
            target_room = room(target)
            if target_room is not None and target_room != source_room:
                rooms[source_room].add(target_room)
                behind[(source_room, target_room)].append((source, target))
    return rooms, behind
