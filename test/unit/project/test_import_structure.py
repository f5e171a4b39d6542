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


def test_pd_endpoint_paths_are_named_only_in_the_protocol():
    """Master and nodes each named the node control paths once more: a path renamed on one side
    would have answered 404 only when the two ran together."""
    pd = PACKAGE / "server" / "pd"
    named = sorted(
        f"{path.relative_to(PACKAGE.parent)}: {target.id}"
        for path in pd.rglob("*.py") if "protocol" not in path.relative_to(pd).parts
        for node in ast.parse(path.read_text(encoding="utf-8")).body if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        and node.value.value.startswith("/pd/")
        for target in node.targets if isinstance(target, ast.Name)
    )
    assert named == []
