"""The TMPDIR check refuses exactly the directories whose IPC socket paths zmq cannot bind."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import zmq

from lightllm.server.launch.plan import IPC_SOCKET_NAMES, MAX_IPC_PATH_BYTES, check_ipc_path_room
from lightllm.utils.owner_locks import ipc_dir_prefix

LONGEST_NAME = max((f"{name}.sock" for name in IPC_SOCKET_NAMES), key=len)


def _temp_dir_for(path_bytes: int, root: Path) -> Path:
    """A directory under ``root`` whose server socket paths are ``path_bytes`` long."""
    fixed = 1 + len(ipc_dir_prefix()) + 8 + 1 + len(LONGEST_NAME)
    missing = path_bytes - fixed - len(str(root)) - 1
    assert missing > 0
    directory = root / ("d" * missing)
    directory.mkdir()
    return directory


def _zmq_binds(temp_dir: Path) -> bool:
    ipc_dir = tempfile.mkdtemp(prefix=ipc_dir_prefix(), dir=temp_dir)
    context = zmq.Context()
    sock = context.socket(zmq.PULL)
    try:
        sock.bind(f"ipc://{ipc_dir}/{LONGEST_NAME}")
        return True
    except zmq.ZMQError:
        return False
    finally:
        sock.close(linger=0)
        context.term()


@pytest.mark.parametrize("path_bytes", [MAX_IPC_PATH_BYTES, MAX_IPC_PATH_BYTES + 1])
def test_the_check_agrees_with_zmq_at_the_limit(path_bytes):
    with tempfile.TemporaryDirectory(dir="/tmp") as root:
        temp_dir = _temp_dir_for(path_bytes, Path(root))
        binds = _zmq_binds(temp_dir)
        if path_bytes <= MAX_IPC_PATH_BYTES:
            assert binds
            check_ipc_path_room(str(temp_dir), ipc_dir_prefix())
        else:
            assert not binds
            with pytest.raises(ValueError, match=r"\(TMPDIR\) is too deep.*at most 107"):
                check_ipc_path_room(str(temp_dir), ipc_dir_prefix())


def test_the_usual_temporary_directory_passes():
    check_ipc_path_room(tempfile.gettempdir(), ipc_dir_prefix())
