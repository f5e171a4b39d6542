"""The launcher refuses bad LIGHTLLM_* values at start: one line naming the variable, exit 2, no traceback.

``LIGHTLLM_API_KEY=","`` used to start a server without authentication, saying nothing;
``LIGHTLLM_TORCH_THREADS=99999`` failed 11 s into start-up with a compiler error naming nothing set.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightllm.server.launch.exit_codes import EXIT_INVALID_CONFIG
from lightllm.utils.envs_utils import max_torch_threads
from lightllm.utils.free_ports import free_port


def _launch(model_dir: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightllm.server.api_server", "--model_dir", str(model_dir),
                           "--port", str(free_port()), "--device", "cpu"], capture_output=True, text=True,
                          timeout=240, env={**os.environ, **env})


@pytest.mark.parametrize("name, value, expected", [
    ("LIGHTLLM_API_KEY", ",", "error: LIGHTLLM_API_KEY holds no key: "),
    ("LIGHTLLM_ADMIN_API_KEY", " ", "error: LIGHTLLM_ADMIN_API_KEY holds no key: "),
    ("LIGHTLLM_TORCH_THREADS", "99999", f"error: LIGHTLLM_TORCH_THREADS must be an integer from 1 to {max_torch_threads()} "),
])
def test_a_bad_variable_is_a_one_line_start_error(tiny_llama_dir: Path, name: str, value: str, expected: str) -> None:
    proc = _launch(tiny_llama_dir, {name: value})
    output = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_INVALID_CONFIG, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(expected), output
    assert "Traceback" not in output and "serving on" not in output
