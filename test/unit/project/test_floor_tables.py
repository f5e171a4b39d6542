"""The architecture page's floor tables say what the imports do, in EN and CN alike.

docs/*/architecture.md puts every room (direct child) of ``lightllm/server/``, ``server/model_rank/``
and ``server/http/`` on a floor and says what it may import. The tables fell behind the code: seven
top-level modules were missing, and ``httpserver/`` imported ``http/`` on the same floor while its row
said it did not. Here every room must have a row, every import between rooms must go to a lower
floor, and a row naming what its rooms may import must name every room they import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, FrozenSet, List, Tuple

import pytest

from import_graph_support import import_edges, room_edges

ROOT = Path(__file__).resolve().parents[3]
EDGES = import_edges(ROOT / "lightllm")
# Where a "May import" cell grants every room below its row (EN), so the cell lists none by name.
EVERYTHING_BELOW = ("anything", "everything below")
# folder -> a room only its table has, to find that table on the page.
TABLES = {"lightllm.server": "api_server", "lightllm.server.model_rank": "rank_assembly",
          "lightllm.server.http": "app"}


@dataclass(frozen=True)
class FloorRow:
    """One row of a floor table: its floor, its rooms, and the rooms its "May import" cell names."""

    floor: int
    rooms: FrozenSet[str]
    may_import: FrozenSet[str]
    everything_below: bool


def _names(cell: str) -> List[str]:
    """The room names written in a cell: ``core/objs/`` is the room ``core``, ``run_mode.py`` is ``run_mode``."""
    return [name.removesuffix("/").removesuffix(".py").split("/")[0] for name in re.findall(r"`([^`]+)`", cell)]


def _table(lang: str, marker: str) -> List[FloorRow]:
    text = (ROOT / "docs" / lang / "architecture.md").read_text()
    tables: List[List[List[str]]] = []
    current: List[List[str]] = []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif current:
            tables.append(current)
            current = []
    for table in tables:
        body = [cells for cells in table[2:] if cells[0].isdigit()]
        if any(marker in _names(cells[1]) for cells in body):
            return [FloorRow(int(cells[0]), frozenset(_names(cells[1])), frozenset(_names(cells[3])),
                             cells[3].lower().startswith(EVERYTHING_BELOW)) for cells in body]
    raise AssertionError(f"docs/{lang}/architecture.md has no floor table with the room {marker}")


def _floors(rows: List[FloorRow]) -> Dict[str, int]:
    floors: Dict[str, int] = {}
    for row in rows:
        for room in row.rooms:
            assert room not in floors, f"{room} has two rows"
            floors[room] = row.floor
    return floors


@pytest.mark.parametrize("folder", sorted(TABLES))
def test_every_room_has_a_row_and_imports_only_rooms_below_it(folder: str) -> None:
    rows = _table("EN", TABLES[folder])
    floors = _floors(rows)
    rooms, behind = room_edges(EDGES, folder)
    assert sorted(set(rooms) - set(floors)) == [], f"rooms of {folder} without a row in the floor table"
    assert sorted(set(floors) - set(rooms)) == [], f"rows of {folder}'s floor table naming no room"
    upward = {f"{a} ({floors[a]}) -> {b} ({floors[b]})": behind[(a, b)][:2]
              for a, targets in rooms.items() for b in targets if floors[b] >= floors[a]}
    assert upward == {}, f"imports of {folder} that do not go down a floor"


@pytest.mark.parametrize("folder", sorted(TABLES))
def test_each_row_names_every_room_its_rooms_import(folder: str) -> None:
    rooms, behind = room_edges(EDGES, folder)
    unnamed = {}
    for row in _table("EN", TABLES[folder]):
        if row.everything_below:
            continue
        for room in row.rooms:
            for target in sorted(rooms[room] - row.may_import):
                unnamed[f"{room} -> {target}"] = behind[(room, target)][:2]
    assert unnamed == {}, f"imports of {folder} its floor table's 'May import' cells do not name"


@pytest.mark.parametrize("folder", sorted(TABLES))
def test_the_cn_table_says_what_the_en_table_says(folder: str) -> None:
    def shape(rows: List[FloorRow]) -> List[Tuple[int, List[str], List[str]]]:
        return [(row.floor, sorted(row.rooms), sorted(row.may_import)) for row in rows]

    assert shape(_table("CN", TABLES[folder])) == shape(_table("EN", TABLES[folder]))

