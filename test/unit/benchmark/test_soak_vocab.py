"""soak_server's prompt ids come from the served model's vocabulary, not a fixed 4096.

With the old default every request to the tiny model (1024 ids) failed with a 400 "token id ...
outside the vocabulary [0, 1024)".
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from cli_refusal_support import one_line_refusal

from lightllm.benchmark import server_process, soak_server
from lightllm.benchmark.soak_server import parse_args, resolve_vocab, server_model_dir
from lightllm.common.basemodel.model_config import ModelConfig


@pytest.fixture
def no_start(monkeypatch):
    """Nothing may start or be measured: a refusal comes before."""

    def start(*args, **kwargs):
        raise AssertionError("a server was started before the refusal")

    monkeypatch.setattr(server_process.ServerProcess, "start", start)
    monkeypatch.setattr(soak_server, "_raise_fd_limit", lambda: None)


@pytest.fixture
def sleeper(tiny_llama_dir):
    """A process whose command line names --model_dir, as a server's does (relative to its cwd)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)",
                             "--model_dir", tiny_llama_dir.name], cwd=str(tiny_llama_dir.parent), stdout=subprocess.PIPE)
    # Until the child has exec'd, /proc shows the command line it was forked with (pytest's).
    assert proc.stdout.readline() == b"up\n"
    yield proc
    proc.kill()
    proc.wait(10)


def test_the_default_is_the_model_dirs_vocabulary(tiny_llama_dir):
    vocab = ModelConfig.from_dir(tiny_llama_dir).vocab_size
    assert vocab < 4096
    assert resolve_vocab(parse_args(["--model_dir", str(tiny_llama_dir)])) == vocab
    assert resolve_vocab(parse_args(["--model_dir", str(tiny_llama_dir), "--vocab", "100"])) == 100


def test_a_targeted_server_gives_its_vocabulary_through_its_command_line(tiny_llama_dir, sleeper):
    assert os.path.samefile(server_model_dir(sleeper.pid), tiny_llama_dir)
    args = parse_args(["--base-url", "http://127.0.0.1:1", "--server-pid", str(sleeper.pid)])
    assert resolve_vocab(args) == ModelConfig.from_dir(tiny_llama_dir).vocab_size


def test_a_vocab_beyond_the_models_is_refused_before_starting(tiny_llama_dir, tmp_path, no_start, capsys):
    line = one_line_refusal(soak_server.main, ["--model_dir", str(tiny_llama_dir), "--vocab", "4096",
                                               "--log-dir", str(tmp_path / "logs")], capsys)
    assert line.startswith("error: --vocab 4096 does not fit the served model's vocabulary (1024 ids"), line


def test_an_unknown_vocabulary_needs_the_flag(tmp_path, no_start, capsys):
    # This test process was not started with --model_dir: nothing tells the served vocabulary.
    argv = ["--base-url", "http://127.0.0.1:1", "--server-pid", str(os.getpid())]
    line = one_line_refusal(soak_server.main, argv, capsys)
    assert line.startswith("error: --vocab is needed: the served model's vocabulary size is unknown"), line
    assert resolve_vocab(parse_args([*argv, "--vocab", "50"])) == 50
