"""The headers of a checkpoint's weight files, checked against each other and against the index, without torch.

:func:`~lightllm.common.basemodel.checkpoint_files.weight_files` decides which files hold the
model from their names alone; a file among them may still be unreadable (truncated by an
interrupted download, empty) or the index may send a tensor to a shard that does not hold it, and
the ranks would find either only after every process started, with safetensors' message naming no
file.  :func:`read_weight_headers` reads each file's header (a few bytes to a few megabytes, never
the tensors), so the launcher refuses such a checkpoint first and the ranks' loader opens only
files that passed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

from lightllm.common.basemodel.checkpoint_files import INDEX_FILE, CheckpointFilesError, read_weight_map, weight_files
from lightllm.common.basemodel.safetensors_header import SafetensorsHeader, read_safetensors_header


def _holders(headers: Dict[Path, SafetensorsHeader], name: str) -> List[str]:
    return sorted(path.name for path, header in headers.items() if name in header.tensors)


def _check_index(directory: Path, weight_map: Dict[str, str], headers: Dict[Path, SafetensorsHeader]) -> None:
    """Refuse an index that assigns a tensor to a shard whose header does not list it."""
    wrong = [(name, file_name) for name, file_name in sorted(weight_map.items())
             if name not in headers[directory / file_name].tensors]
    if not wrong:
        return
    name, file_name = wrong[0]
    holders = _holders(headers, name)
    where = f"{', '.join(holders)} does" if holders else "no weight file does"
    more = f" ({len(wrong) - 1} more tensor(s) likewise)" if len(wrong) > 1 else ""
    raise CheckpointFilesError(f"{directory / INDEX_FILE} assigns tensor {name!r} to {file_name}, which does not "
                               f"hold it ({where}){more}: the index does not match the shards")


def read_weight_headers(model_dir: str | Path) -> Dict[Path, SafetensorsHeader]:
    """The header of each of ``model_dir``'s weight files (:func:`weight_files`), by path, in file order.

    Raises :class:`CheckpointFilesError` (one line naming the file) for the file list's refusals,
    a file the ranks' reader could not open (:func:`read_safetensors_header`), or an index
    assigning a tensor to a shard that does not hold it.
    """
    directory = Path(model_dir)
    headers = {path: read_safetensors_header(path) for path in weight_files(directory)}
    weight_map = read_weight_map(directory)
    if weight_map is not None:
        _check_index(directory, weight_map, headers)
    return headers
