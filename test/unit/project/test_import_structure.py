"""The package's shape as a test: no import circles, rooms on floors, torch only in the rank.

A "room" is a direct child (module or package) of a folder; rooms are on floors when no room
imports one that imports it back. The review of the architecture (shared/reviews) counted four
file circles and a room circle in ``lightllm/server/``; these tests keep them from coming back.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from import_graph_support import import_edges, room_edges, strongly_connected

PACKAGE = Path(__file__).resolve().parents[3] / "lightllm"
EDGES = import_edges(PACKAGE)


def test_no_module_imports_itself_back_through_others():
    circles = strongly_connected(EDGES, EDGES)
    assert circles == [], f"import circles: {circles}"


@pytest.mark.parametrize("folder", ["lightllm", "lightllm.server", "lightllm.server.model_rank", "lightllm.server.pd",
                                    "lightllm.server.http", "lightllm.server.launch", "lightllm.common"])
def test_rooms_of_a_folder_stand_on_floors(folder: str):
    rooms, behind = room_edges(EDGES, folder)
    circles = strongly_connected(rooms, rooms)
    detail = {f"{a} -> {b}": behind[(a, b)][:3] for circle in circles for a in circle for b in circle if (a, b) in behind}
    assert circles == [], f"rooms of {folder} import each other in a circle: {detail}"


def test_scheduling_core_imports_nothing_of_the_execution_side():
    core = "lightllm.server.model_rank.scheduling"
    outside = {
        (source, target) for source, targets in EDGES.items() if source.startswith(core)
        for target in targets if not target.startswith(core)
    }
    # request_spec: the request as plain data (no torch), which the backends take whole.
    allowed_prefixes = ("lightllm.server.core.objs.finish_status", "lightllm.server.core.objs.request_spec",
                        "lightllm.common.sampling.sampling_params",
                        "lightllm.common.sampling.storage_width", "lightllm.common.sampling")
    assert sorted(t for s, t in outside if not t.startswith(allowed_prefixes)) == []


def test_nothing_below_launch_imports_the_launcher():
    launch = "lightllm.server.launch"
    importers = sorted({source for source, targets in EDGES.items()
                        if not source.startswith(launch) and source != "lightllm.server.api_server"
                        and any(t.startswith(launch) for t in targets)})
    assert importers == []


def test_pd_master_and_nodes_meet_only_in_the_protocol():
    master, node = "lightllm.server.pd.master", "lightllm.server.pd.node"
    crossing = sorted((source, target) for source, targets in EDGES.items() for target in targets
                      if (source.startswith(master) and target.startswith(node))
                      or (source.startswith(node) and target.startswith(master)))
    assert crossing == []


def test_pd_protocol_imports_nothing_of_the_http_layer():
    # The wire contract is shared by master and nodes; turning a body into a 400 is the node's part.
    protocol, http = "lightllm.server.pd.protocol", "lightllm.server.http"
    crossing = sorted((source, target) for source, targets in EDGES.items() if source.startswith(protocol)
                      for target in targets if target.startswith(http))
    assert crossing == []


# The namespace, no path: the key guard (http/middleware/auth.py) holds every path under it to the
# cluster key.  It stays in the http layer: pd imports http, so http importing pd/protocol for it
# would put the two rooms in a circle.
CLUSTER_PREFIX = "/pd/"


def _docstrings(tree: ast.AST) -> set:
    """The ids of the docstring constants of ``tree`` (module, class and function), which may name paths."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                found.add(id(first.value))
    return found


def pd_paths_outside_the_protocol(package: Path) -> list:
    """``file:line: '/pd/...'`` for every string constant outside ``server/pd/protocol`` naming a PD path.

    Every constant counts (an inline literal, a class or annotated attribute, an f-string's text
    part, a default argument), not only module-level assignments; docstrings only describe.
    """
    protocol = package / "server" / "pd" / "protocol"
    named = []
    for path in sorted(package.rglob("*.py")):
        if protocol in path.parents:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = _docstrings(tree)
        named.extend(f"{path.relative_to(package.parent)}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
                     if isinstance(node, ast.Constant) and isinstance(node.value, str)
                     and node.value.startswith("/pd/") and node.value != CLUSTER_PREFIX
                     and id(node) not in docstrings)
    return named


def test_pd_endpoint_paths_are_named_only_in_the_protocol():
    """Master and nodes each named the node control paths once more: a path renamed on one side
    would have answered 404 only when the two ran together."""
    assert pd_paths_outside_the_protocol(PACKAGE) == []


def test_the_path_scan_finds_a_path_however_it_is_written(tmp_path):
    """The scan read only module-level plain assignments, so an inline literal passed unseen."""
    module = tmp_path / "lightllm" / "server" / "pd" / "node" / "calls.py"
    module.parent.mkdir(parents=True)
    module.write_text('''"""Calls /pd/heartbeat (a docstring: not counted)."""
PLAIN = "/pd/a"
TYPED: str = "/pd/b"


class Client:
    """Posts to /pd/register."""
    path = "/pd/c"

    def call(self, node_id, where="/pd/d"):
        """Calls /pd/e."""
        return post("/pd/f", f"/pd/g/{node_id}", prefix="/pd/")
''', encoding="utf-8")
    (tmp_path / "lightllm" / "server" / "pd" / "protocol").mkdir()
    (tmp_path / "lightllm" / "server" / "pd" / "protocol" / "paths.py").write_text('HEARTBEAT = "/pd/heartbeat"\n')
    found = [entry.rpartition(": ")[2] for entry in pd_paths_outside_the_protocol(tmp_path / "lightllm")]
    assert found == ["'/pd/a'", "'/pd/b'", "'/pd/c'", "'/pd/d'", "'/pd/f'", "'/pd/g/'"]


def test_every_protocol_path_is_under_the_prefix_the_cluster_key_guards():
    # The prefix is named in the http layer (see CLUSTER_PREFIX): a path moved out of it would be
    # open to client keys and closed to the nodes' cluster key.
    from lightllm.server.http.middleware.auth import CLUSTER_PATH_PREFIX
    from lightllm.server.pd.protocol import membership

    paths = [value for name, value in vars(membership).items() if name.endswith("_PATH")]
    assert CLUSTER_PATH_PREFIX == CLUSTER_PREFIX and len(paths) >= 8
    assert [path for path in paths if not path.startswith(CLUSTER_PATH_PREFIX)] == []
