"""The side-by-side runner: case parsing, the client's command line, result reading, the seeds
each case gets (distinct, so no case hits the prefix cache an earlier one filled) and the table.

The client is a stand-in script with ``vllm bench serve``'s interface (it records its arguments
and writes a ``--save-result`` file); vLLM itself is not installed in the test environment.
"""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import types
from pathlib import Path

import pytest

from lightllm.benchmark import side_by_side
from lightllm.benchmark.side_by_side import client_command, markdown_table, read_client_result
from lightllm.benchmark.side_by_side_cases import Case, parse_cases, parse_engines

FAKE_CLIENT = """#!{python}
import json, sys
args = sys.argv[1:]
def value(flag):
    return args[args.index(flag) + 1]
with open({log!r}, "a") as log:
    log.write(json.dumps(args) + "\\n")
prompts = int(value("--num-prompts"))
result = {{"duration": 1.5, "completed": prompts, "total_input_tokens": prompts * int(value("--random-input-len")),
          "output_throughput": 100.0 + int(value("--seed")), "median_ttft_ms": 20.0, "median_tpot_ms": 5.0}}
with open(value("--result-dir") + "/" + value("--result-filename"), "w") as out:
    json.dump(result, out)
"""


def test_parse_cases_reads_prompts_input_output() -> None:
    assert parse_cases("64x128x64, 8x1024x8") == [Case(64, 128, 64), Case(8, 1024, 8)]
    assert Case(64, 128, 64).label == "64x128x64"


def test_a_case_may_share_a_prefix_and_the_client_is_told() -> None:
    case = parse_cases("64x1024+128x64")[0]
    assert case == Case(64, 128, 64, prefix_len=1024) and case.label == "64x1024+128x64"
    command = client_command(Path("/v/bin/vllm"), "http://127.0.0.1:1", "/m", case, 3, Path("/r"), "f.json")
    assert command[command.index("--random-prefix-len") + 1] == "1024"
    assert command[command.index("--random-input-len") + 1] == "128"
    assert "--random-prefix-len" not in client_command(Path("/v"), "u", "/m", Case(8, 64, 8), 0, Path("/r"), "f")


@pytest.mark.parametrize("text", ["64x128", "64x0x8", "ax1x1", "", "64x128x64,", "64x1+2+3x8", "64x0+128x8", "64x+128x8"])
def test_parse_cases_names_the_bad_item(text: str) -> None:
    with pytest.raises(ValueError, match="PROMPTSxINPUTxOUTPUT"):
        parse_cases(text)


def test_parse_engines_keeps_order_and_repeats_and_refuses_unknown_names() -> None:
    assert parse_engines("ours,vllm_every_core,ours") == ["ours", "vllm_every_core", "ours"]
    with pytest.raises(ValueError, match="vllm_default"):
        parse_engines("ours,vllm")


def test_client_command_is_the_same_for_every_engine_but_the_url() -> None:
    command = client_command(Path("/v/bin/vllm"), "http://127.0.0.1:1", "/m", Case(8, 1024, 8), 3, Path("/r"), "f.json")
    assert command[:3] == ["/v/bin/vllm", "bench", "serve"]

    def value(flag: str) -> str:
        return command[command.index(flag) + 1]

    assert value("--random-input-len") == "1024" and value("--num-prompts") == "8" and value("--seed") == "3"
    assert value("--model") == "/m" and value("--tokenizer") == "/m" and value("--request-rate") == "inf"
    assert "--ignore-eos" in command and value("--temperature") == "0" and value("--base-url") == "http://127.0.0.1:1"


def test_read_client_result_refuses_a_run_that_lost_prompts(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    base = {m: 1.0 for m in side_by_side.METRICS}
    path.write_text(json.dumps(dict(base, completed=8)))
    assert read_client_result(path, Case(8, 64, 8))["completed"] == 8
    path.write_text(json.dumps(dict(base, completed=7)))
    with pytest.raises(RuntimeError, match="7 of 8 prompts"):
        read_client_result(path, Case(8, 64, 8))
    path.write_text(json.dumps({"completed": 8}))
    with pytest.raises(RuntimeError, match="no"):
        read_client_result(path, Case(8, 64, 8))


def test_every_case_and_the_warmup_get_their_own_seed(tmp_path: Path) -> None:
    log = tmp_path / "calls.jsonl"
    client = tmp_path / "vllm"
    client.write_text(FAKE_CLIENT.format(python=sys.executable, log=str(log)))
    client.chmod(client.stat().st_mode | stat.S_IEXEC)
    server = types.SimpleNamespace(engine="ours", base_url="http://127.0.0.1:9", model_dir="/m")
    cases = parse_cases("32x2048x8,64x1024x128,16x1024x8")
    results = side_by_side.run_engine(server, cases, 7, client, tmp_path, 0)
    seeds = [int(args[args.index("--seed") + 1]) for args in map(json.loads, log.read_text().splitlines())]
    assert len(seeds) == 1 + len(cases) and len(set(seeds)) == len(seeds)
    assert seeds[1:] == [7, 8, 9]
    assert [results[c.label]["output_throughput"] for c in cases] == [107.0, 108.0, 109.0]


def test_markdown_table_divides_each_run_of_ours_by_each_vllm_run() -> None:
    def metrics(tok_s: float) -> dict:
        return {"output_throughput": tok_s, "median_ttft_ms": 10.0, "median_tpot_ms": 2.0}

    case = Case(8, 64, 8)
    runs = [
        {"engine": "ours", "results": {case.label: metrics(120.0)}},
        {"engine": "vllm_every_core", "results": {case.label: metrics(100.0)}},
        {"engine": "ours", "results": {case.label: metrics(90.0)}},
    ]
    table = markdown_table([case], runs)
    assert "| 8x64x8 | 2 | vllm_every_core | 100.0 | 10 | 2.0 | 1.20x, 0.90x |" in table


def test_cli_refuses_bad_cases_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lightllm.benchmark.side_by_side", "--model_dir", str(tmp_path), "--cases", "64x128"],
        capture_output=True, text=True,
    )
    assert done.returncode == 2
    assert "PROMPTSxINPUTxOUTPUT" in done.stderr and "Traceback" not in done.stderr


def test_a_server_that_cannot_start_is_reported_with_its_log(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{not json")
    server = side_by_side.EngineServer("ours", str(model_dir), tmp_path, tmp_path, [], tmp_path)
    with pytest.raises(RuntimeError, match="ours exited with") as raised:
        with server:
            pass
    assert "config.json" in str(raised.value)  # the server's own one-line error, from its log
