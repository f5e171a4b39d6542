"""The outside tester's report on the command-line tools (items 3, 6, 8-13): each tool refuses bad
input in one line naming the flag, ends a Ctrl-C in one line with status 130, and states its defaults."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from fastapi import FastAPI, Request

from canned_server import serve
from cli_refusal_support import one_line_refusal, parser_of
from lightllm.benchmark import bench_burst, bench_decode_attention, bench_hf_baseline, compare_strategies, health_latency
from lightllm.benchmark.simulator import bound_sweep, cell_cli, frontier, schedule_cost
from lightllm.utils import demo_model

FULL = "/dev/full"


# --- item 3: bench_burst and a file it cannot write ----------------------------------------------


@pytest.fixture(scope="module")
def completions_server() -> Iterator[str]:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"data": [{"id": "m"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        body = await request.json()
        return {"usage": {"completion_tokens": body["max_tokens"]}}

    with serve(app) as base_url:
        yield base_url


@pytest.mark.skipif(not Path(FULL).exists(), reason="needs /dev/full")
def test_bench_burst_names_an_output_it_cannot_write_after_the_rounds(completions_server, capsys) -> None:
    argv = ["--base-url", completions_server, "--num-requests", "2", "--prompt-len", "4", "--output-len", "2",
            "--rounds", "1", "--output-json", FULL]
    with pytest.raises(SystemExit) as exit_info:
        bench_burst.main(argv)
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and "round 0: 4 tokens" in captured.out
    assert captured.err.splitlines() == [f"error: --output-json {FULL!r} could not be written: No space left on "
                                         "device (--help lists the flags)"]


# --- item 6: Ctrl-C ------------------------------------------------------------------------------

_TOOLS = ["lightllm.benchmark.simulator.__main__", "lightllm.benchmark.simulator.frontier",
          "lightllm.benchmark.simulator.deadline_frontier", "lightllm.benchmark.simulator.bound_sweep",
          "lightllm.benchmark.simulator.schedule_cost", "lightllm.benchmark.simulator.fit_cost_profile",
          "lightllm.benchmark.simulator.derive_h100_profile", "lightllm.benchmark.health_latency",
          "lightllm.benchmark.bench_burst", "lightllm.benchmark.bench_hf_baseline",
          "lightllm.server.pd.kv_transfer.bench"]


@pytest.mark.parametrize("module", _TOOLS)
def test_ctrl_c_is_one_line_and_exit_130(module, monkeypatch, capsys) -> None:
    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    # The same deterministic point in every tool: while its flags are read.
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", interrupted)
    assert importlib.import_module(module).main([]) == 130
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: interrupted; ") and "Traceback" not in err, err


def test_health_latency_stops_its_prober_on_ctrl_c(monkeypatch) -> None:
    started = []

    class Process:
        def __init__(self, **_kwargs):
            self.alive = False

        def start(self):
            self.alive = True
            started.append(self)

        def is_alive(self):
            return self.alive

        def terminate(self):
            self.alive = False

        def join(self):
            pass

    class End:
        def recv(self):
            raise KeyboardInterrupt  # Ctrl-C while the prober runs

        def close(self):
            pass

    context = argparse.Namespace(Process=Process, Pipe=lambda duplex: (End(), End()))
    monkeypatch.setattr(health_latency.mp, "get_context", lambda _name: context)
    args = argparse.Namespace(max_new_tokens=1, api_key=None, streams=0, hold=0, hold_source="127.0.0.2", warmup=0,
                              control=False, probe_path="/health", probe_interval=0.1, duration=1)
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(health_latency._load(args, "127.0.0.1", 9))
    assert len(started) == 1 and not any(process.alive for process in started)


def _hold_the_pipe(connection: Any) -> None:
    """A prober that holds its pipe and never answers."""
    time.sleep(3600)


def test_health_latency_ends_on_ctrl_c_while_it_waits_for_the_probers_results(monkeypatch) -> None:
    # The real pipe and a real process that never answers: the wait for its results must end once
    # the prober is stopped (the parent held the pipe's write end, so the read never saw its end and
    # asyncio.run waited for that thread forever).
    real = health_latency.mp.get_context("spawn")
    started = []

    def process(target, args, **_kwargs):
        # The prober's arguments hold the pipe's write end (index 5), as the real prober's do.
        started.append(real.Process(target=_hold_the_pipe, args=(args[5],)))
        return started[-1]

    monkeypatch.setattr(health_latency.mp, "get_context", lambda _name: argparse.Namespace(Process=process,
                                                                                            Pipe=real.Pipe))
    args = argparse.Namespace(max_new_tokens=1, api_key=None, streams=0, hold=0, hold_source="127.0.0.2", warmup=0,
                              control=False, probe_path="/health", probe_interval=0.1, duration=1)
    outcome = []

    async def interrupted() -> None:
        task = asyncio.ensure_future(health_latency._load(args, "127.0.0.1", 9))
        while not task.done() and not (started and started[-1].is_alive()):
            await asyncio.sleep(0.01)
        task.cancel()  # what asyncio.run does with the main task on Ctrl-C
        try:
            await task
        except asyncio.CancelledError as exc:
            # Kept, as asyncio.run keeps the KeyboardInterrupt it raises: its traceback holds _load's frame.
            outcome.append(exc)

    runner = threading.Thread(target=asyncio.run, args=(interrupted(),), daemon=True)
    runner.start()
    runner.join(120)  # a bound on a hang, not a timing: it ends in well under a second
    assert not runner.is_alive() and [type(exc) for exc in outcome] == [asyncio.CancelledError]
    assert not started[-1].is_alive()


def test_health_latency_says_so_when_the_prober_ends_without_results(monkeypatch) -> None:
    real = health_latency.mp.get_context("spawn")
    monkeypatch.setattr(health_latency.mp, "get_context", lambda _name: argparse.Namespace(
        Process=lambda **_kwargs: real.Process(target=time.sleep, args=(0,)), Pipe=real.Pipe))
    args = argparse.Namespace(max_new_tokens=1, api_key=None, streams=0, hold=0, hold_source="127.0.0.2", warmup=0,
                              control=False, probe_path="/health", probe_interval=0.1, duration=1)
    with pytest.raises(health_latency.ProberEnded, match="ended without sending its results"):
        asyncio.run(health_latency._load(args, "127.0.0.1", 9))


# --- item 8: bound_sweep --strategies with default in a list --------------------------------------


def test_bound_sweep_refuses_default_inside_a_list(capsys) -> None:
    line = one_line_refusal(bound_sweep.main, ["--cells", "long_first/normal/1024", "--strategies", "hrrn,default",
                                               "--bases", "2048", "--fractions", "0.1"], capsys)
    assert "--strategies names default, which every row is compared with" in line


# --- item 9: frontier --counts ranges ------------------------------------------------------------


def test_a_range_step_below_one_is_named() -> None:
    with pytest.raises(ValueError, match=r"the range '260-320/0' has STEP 0; LOW-HIGH/STEP needs STEP >= 1"):
        cell_cli.int_range("260-320/0")
    with pytest.raises(ValueError, match=r"has STEP -1"):
        cell_cli.int_range("10-20/-1")


def test_a_range_without_step_is_step_one_and_said_so(monkeypatch) -> None:
    assert cell_cli.int_range("10-13") == [10, 11, 12, 13]
    help_text = " ".join(parser_of(frontier.main, monkeypatch).format_help().split())
    assert "LOW-HIGH/STEP ranges (LOW-HIGH: step 1)" in help_text


# --- item 10: negative seeds ---------------------------------------------------------------------


@pytest.mark.parametrize("main, argv", [
    (bench_burst.main, ["--seed", "-1"]),
    (bench_hf_baseline.main, ["--model_dir", "/nonexistent", "--seed", "-1"]),
])
def test_a_negative_seed_is_refused(main, argv, capsys) -> None:
    assert "argument --seed: must be an integer >= 0, got -1" in one_line_refusal(main, argv, capsys)


# --- item 11: health_latency --hold_source without --hold ----------------------------------------


def test_hold_source_without_hold_is_refused(capsys) -> None:
    line = one_line_refusal(health_latency.main, ["--url", "http://127.0.0.1:9", "--hold_source", "127.0.0.2",
                                                  "--duration", "1"], capsys)
    assert line.startswith("error: --hold_source is the source address of the --hold connections")


# --- item 12: --help states the defaults, from the parser's own defaults ---------------------------


@pytest.mark.parametrize("main, flags", [
    (compare_strategies.main, ["--strategies", "--baseline", "--repeats", "--warmup", "--kv-tokens",
                               "--start-timeout", "--seed"]),
    (schedule_cost.main, ["--repeats", "--warmup", "--server-repeats", "--server-warmup"]),
    (bound_sweep.main, ["--strategies"]),
    (frontier.main, ["--profile", "--seed"]),
    (demo_model.main, ["--arch"]),
    (importlib.import_module("lightllm.benchmark.bench_serving").main, ["--warmup-runs"]),
])
def test_help_states_each_default(main, flags, monkeypatch) -> None:
    parser = parser_of(main, monkeypatch)
    for action in parser._actions:
        if action.option_strings and action.option_strings[0] in flags:
            help_text = " ".join((action.help % {"default": action.default}).split())
            default = f"{action.default:g}" if isinstance(action.default, float) else str(action.default)
            assert f"default {default}" in help_text, (action.option_strings[0], help_text)


# --- item 13: errors name the flag ---------------------------------------------------------------


def test_bench_decode_attention_names_the_list_flag(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text("{}")
    line = one_line_refusal(bench_decode_attention.main, ["--model_dir", str(tmp_path), "--batches", "abc"], capsys)
    assert "argument --batches: expected comma-separated positive integers, got 'abc'" in line


@pytest.mark.parametrize("argv, message", [
    (["--seed", "-1"], "error: --seed must be in [0, 2**64 - 1], got -1"),
    (["--out", "<file>"], "error: --out '<file>' exists and is not a directory"),
])
def test_demo_model_names_its_flags(argv, message, tmp_path, capsys) -> None:
    existing = tmp_path / "srv.log"
    existing.write_text("")
    argv = [str(existing) if word == "<file>" else word for word in argv]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "model")]
    line = one_line_refusal(demo_model.main, argv, capsys)
    assert line.startswith(message.replace("<file>", str(existing))), line


@pytest.mark.parametrize("main", [compare_strategies.main, importlib.import_module("lightllm.benchmark.bench_serving").main])
def test_max_concurrency_zero_names_the_flag(main, tmp_path, capsys) -> None:
    argv = ["--max-concurrency", "0", "--tokenizer", str(tmp_path), "--model_dir", str(tmp_path),
            "--out-dir", str(tmp_path / "out")]
    if main is not compare_strategies.main:
        argv = ["--max-concurrency", "0", "--tokenizer", str(tmp_path)]
    assert "argument --max-concurrency: must be an integer >= 1, got 0" in one_line_refusal(main, argv, capsys)
