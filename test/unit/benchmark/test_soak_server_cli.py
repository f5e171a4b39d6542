"""``soak_server --model_dir`` names a checkpoint directory that is missing, and a server that will not
start, in one line (they used to end in a ServerStartError traceback after a start attempt)."""

from __future__ import annotations

import pytest
from cli_refusal_support import one_line_refusal

from lightllm.benchmark import server_process, soak_server
from lightllm.benchmark.server_process import ServerStartError


@pytest.fixture
def no_server(monkeypatch):
    """Starting a server fails the way a server that refuses its checkpoint does (none is started)."""

    def start(*args, **kwargs):
        raise ServerStartError("the server exited during start-up: error: --model_dir has no config.json")

    monkeypatch.setattr(server_process.ServerProcess, "start", start)
    monkeypatch.setattr(soak_server, "_raise_fd_limit", lambda: None)


@pytest.mark.parametrize("model_dir", ["/nonexistent/dir", "<empty>"])
def test_a_model_dir_that_is_no_checkpoint_is_named_in_one_line(model_dir, tmp_path, no_server, capsys):
    model_dir = str(tmp_path) if model_dir == "<empty>" else model_dir
    line = one_line_refusal(soak_server.main, ["--model_dir", model_dir, "--log-dir", str(tmp_path / "logs")], capsys)
    assert "--model_dir" in line and model_dir in line, line


def test_a_server_that_does_not_start_ends_the_soak_in_one_line(tiny_llama_dir, tmp_path, no_server, capsys):
    argv = ["--model_dir", str(tiny_llama_dir), "--log-dir", str(tmp_path / "logs")]
    assert soak_server.main(argv) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: ") and "no config.json" in err[0], err
