"""side_by_side refuses before any engine starts what used to fail only after one had started.

A negative --seed was the client's traceback, a case of INPUT 1 the client's traceback pasted into
the error line, --port in --server_args a refused start, a case longer than the context a run that
reported success on cut outputs; a failure's error line named a log in a directory already
deleted, and the --ports warning came before a refusal of --model_dir.
"""

from __future__ import annotations

import re
import shutil
import stat
import sys
import types
from pathlib import Path

import pytest
from cli_refusal_support import one_line_refusal

from lightllm.benchmark import side_by_side
from lightllm.benchmark.side_by_side_cases import Case
from lightllm.benchmark.side_by_side_checks import check_client_lengths, check_seeds
from lightllm.utils.free_ports import read_ephemeral_range


def _never(*args, **kwargs):
    raise AssertionError("an engine was started before the flags were checked")


def _refusal(argv, model_dir, monkeypatch, capsys) -> str:
    monkeypatch.setattr(side_by_side, "EngineServer", _never)
    return one_line_refusal(side_by_side.main, ["--model_dir", str(model_dir), "--engines", "ours", *argv], capsys)


@pytest.mark.parametrize("argv, named", [
    (["--cases", "2x8x4", "--seed", "-1"], "--seed"),
    (["--cases", "2x8x4", "--seed", str(2**32 - 1)], "--seed"),
    (["--cases", "2x8x4", "--server_args", "--port 3"], "--port"),
    (["--cases", "2x8x4", "--server_args=--port=3"], "--port"),
    (["--cases", "2x8x4", "--server_args", "--model_name other"], "--model_name"),
    (["--cases", "2x1x4"], "2x1x4"),
])
def test_a_value_the_run_would_fail_on_is_refused_before_any_engine(argv, named, tiny_llama_dir, monkeypatch, capsys):
    line = _refusal(argv, tiny_llama_dir, monkeypatch, capsys)
    assert named in line, line


@pytest.mark.parametrize("case, consequence", [("2x1020x10", "cut such a request's output to 4 tokens"),
                                               ("2x2000x4", "HTTP 400"),
                                               ("2x1000+20x10", "cut such a request's output to 4 tokens")])
def test_a_case_beyond_the_context_is_refused(case, consequence, tiny_llama_dir, monkeypatch, capsys):
    line = _refusal(["--cases", case], tiny_llama_dir, monkeypatch, capsys)
    assert case in line and "context of 1024" in line and consequence in line, line


def test_the_context_is_the_one_server_args_give_our_server(tiny_llama_dir, monkeypatch, capsys):
    line = _refusal(["--cases", "2x64x8", "--server_args", "--max_req_total_len 32"], tiny_llama_dir, monkeypatch,
                    capsys)
    assert "--max_req_total_len 32 in --server_args" in line, line


def test_a_case_that_fits_passes_every_check(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    # Past the checks: stopped by the missing client, the first thing a run needs from outside.
    line = _refusal(["--cases", "2x1+1x4,2x1000x24", "--peer_dir", str(tmp_path)], tiny_llama_dir, monkeypatch, capsys)
    assert "venv-vllm" in line, line


def test_the_port_warning_never_precedes_a_refusal(tmp_path, monkeypatch, capsys):
    ephemeral = read_ephemeral_range()
    if ephemeral is None:
        pytest.skip("no ephemeral port range to overlap here")
    first = max(ephemeral[0], 1024)
    line = _refusal(["--cases", "2x8x4", "--ports", f"{first}-{first + 9}"], tmp_path / "none", monkeypatch, capsys)
    assert "--model_dir" in line, line


def test_check_seeds_counts_the_warm_up_and_every_case():
    check_seeds(0, [Case(1, 8, 1)] * 3)
    check_seeds(2**32 - 1 - side_by_side.WARMUP_SEED_OFFSET, [Case(1, 8, 1)])
    with pytest.raises(ValueError, match="--seed"):
        check_seeds(2**32 - side_by_side.WARMUP_SEED_OFFSET, [Case(1, 8, 1)])


def test_check_client_lengths_follows_the_clients_rule():
    check_client_lengths([Case(1, 2, 1), Case(1, 1, 1, prefix_len=1)], special_tokens=1)
    with pytest.raises(ValueError, match="INPUT above 1"):
        check_client_lengths([Case(1, 1, 1)], special_tokens=1)


FAILING_CLIENT = """#!{python}
import sys
print("Traceback (most recent call last):")
print('  File "serve.py", line 1, in main')
print("ValueError: the client's own complaint", file=sys.stderr)
sys.exit(1)
"""


def test_a_failing_client_is_one_line_naming_its_kept_log(tmp_path):
    client = tmp_path / "vllm"
    client.write_text(FAILING_CLIENT.format(python=sys.executable))
    client.chmod(client.stat().st_mode | stat.S_IEXEC)
    server = types.SimpleNamespace(engine="ours", base_url="http://127.0.0.1:9", model_dir="/m")
    with pytest.raises(RuntimeError) as raised:
        side_by_side.run_engine(server, [Case(2, 8, 4)], 0, client, tmp_path, 0)
    message = str(raised.value)
    assert "\n" not in message and "ValueError: the client's own complaint" in message
    log = Path(message.rsplit("(log ", 1)[1].rstrip(")"))
    assert "Traceback" in log.read_text()


def test_a_server_that_refuses_to_start_leaves_its_log_named_and_readable(tmp_path, capsys):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{not json")
    _fake_peer(tmp_path / "peer", '[ "$1" = --version ] && exit 0; exit 1')
    status = side_by_side.main(["--model_dir", str(model_dir), "--engines", "ours", "--cases", "2x8x4",
                                "--peer_dir", str(tmp_path / "peer")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert status == 1 and len(err) == 1 and err[0].startswith("error: ours:"), err
    log = Path(re.search(r"log (\S+\.log)", err[0]).group(1))
    kept = Path(err[0].rsplit("kept in ", 1)[1])
    try:
        assert log.parent == kept and "config.json" in log.read_text()
    finally:
        shutil.rmtree(kept, ignore_errors=True)


def _fake_peer(peer_dir: Path, script: str) -> Path:
    """A ``venv-vllm/bin/vllm`` under ``peer_dir`` that runs ``script`` (sh)."""
    vllm = peer_dir / "venv-vllm" / "bin" / "vllm"
    vllm.parent.mkdir(parents=True)
    vllm.write_text("#!/bin/sh\n" + script + "\n")
    vllm.chmod(vllm.stat().st_mode | stat.S_IXUSR)
    return vllm


def test_a_peer_this_cpu_cannot_run_is_refused_before_any_engine(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """vLLM's CPU build dies of SIGILL at import on a CPU without AVX-512: that was "client failed:
    (no output)" at the first warm-up, after our server had loaded."""
    _fake_peer(tmp_path, "kill -ILL $$")
    line = _refusal(["--cases", "2x8x4", "--peer_dir", str(tmp_path)], tiny_llama_dir, monkeypatch, capsys)
    assert "vllm --version died of SIGILL, an illegal instruction: the build uses CPU instructions this machine lacks" in line, line
    assert "nothing can be measured with it" in line, line


def test_a_peer_that_fails_says_its_last_line(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    _fake_peer(tmp_path, "echo 'ImportError: no module named vllm._C'; exit 3")
    line = _refusal(["--cases", "2x8x4", "--peer_dir", str(tmp_path)], tiny_llama_dir, monkeypatch, capsys)
    assert "--version exited with 3: ImportError: no module named vllm._C;" in line, line


def test_a_client_that_dies_silently_is_named_by_its_end(tmp_path):
    script = tmp_path / "client"
    script.write_text("#!/bin/sh\nkill -SEGV $$\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(RuntimeError, match=r"client failed on warm-up: it died of SIGSEGV \(log "):
        side_by_side._run_client([str(script)], tmp_path / "client.log", "warm-up")
