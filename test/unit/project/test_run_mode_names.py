"""Server code branches on the run mode through ``RunMode``'s members, never a spelled-out name, so
a renamed or added role is one edit in ``lightllm/server/run_mode.py`` (its module docstring's rule)."""

from __future__ import annotations

import ast
from pathlib import Path

from lightllm.server.run_mode import RUN_MODES

SERVER = Path(__file__).resolve().parents[3] / "lightllm" / "server"


def _literal_mode_comparisons(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for operand in operands:
            values = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
            for value in values:
                if isinstance(value, ast.Constant) and value.value in RUN_MODES:
                    found.append(f"{path.relative_to(SERVER.parent.parent)}:{node.lineno} compares with {value.value!r}")
    return found


def test_no_server_module_compares_a_run_mode_with_its_spelled_out_name():
    found = [hit for path in sorted(SERVER.rglob("*.py")) for hit in _literal_mode_comparisons(path)]
    assert not found, "use RunMode's members:\n" + "\n".join(found)
