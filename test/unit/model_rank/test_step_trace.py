"""Rank 0's per-step trace: its rows, and LIGHTLLM_STEP_TRACE read and refused at start-up."""

from __future__ import annotations

import csv
import mmap

import pytest

from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.server.launch.args_check import validate_args
from lightllm.server.launch.arg_parser import make_argument_parser
from lightllm.server.launch.plan import build_process_configs, plan_layout, resolve_sampling_seed
from lightllm.server.launch.sizing import plan_sizing
from lightllm.server.model_rank.scheduling.step_report import StepReport
from lightllm.server.model_rank.step_trace import COLUMNS, StepTrace, minor_faults
from lightllm.utils.envs_utils import step_trace_path


def test_a_row_per_working_step_with_its_phases_and_faults(tmp_path):
    now, faults = [100.0], [1000]
    trace = StepTrace(str(tmp_path / "steps.csv"), clock=lambda: now[0], faults=lambda: faults[0])
    trace.begin()
    now[0], faults[0] = 100.5, 1040
    trace.stepped()
    now[0] = 100.502
    trace.end(StepReport(prefill_token_num=1030, decode_batch_size=6, schedule_seconds=0.0001,
                         forward_seconds=0.45, post_seconds=0.0005))
    trace.begin()
    trace.stepped()
    trace.end(StepReport())  # no forward: no row
    now[0] = 101.0
    trace.begin()
    now[0] = 101.02
    trace.stepped()
    trace.end(StepReport(decode_batch_size=64, forward_seconds=0.019))
    trace.close()
    trace.end(StepReport(decode_batch_size=1))  # after close: dropped, not an error
    with open(tmp_path / "steps.csv", encoding="utf-8") as file:
        rows = list(csv.DictReader(file))
    assert tuple(rows[0]) == COLUMNS and len(rows) == 2
    first, second = rows
    assert float(first["t_s"]) == pytest.approx(0.0) and float(first["step_ms"]) == pytest.approx(500.0)
    assert float(first["publish_ms"]) == pytest.approx(2.0) and float(first["forward_ms"]) == pytest.approx(450.0)
    assert (first["prefill_tokens"], first["decode_rows"], first["minor_faults"]) == ("1030", "6", "40")
    assert float(second["t_s"]) == pytest.approx(1.0) and second["decode_rows"] == "64" and second["minor_faults"] == "0"


def test_minor_faults_count_this_process_touching_new_memory():
    block = mmap.mmap(-1, 16 << 20)  # fresh pages (freed heap could already be resident)
    before = minor_faults()
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    assert minor_faults() - before > 1000  # 16 MiB is thousands of pages
    block.close()


def test_the_variable_is_checked_at_start_up_and_reaches_the_ranks(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("LIGHTLLM_STEP_TRACE", raising=False)
    assert step_trace_path() is None
    monkeypatch.setenv("LIGHTLLM_STEP_TRACE", str(tmp_path / "steps.csv"))
    assert step_trace_path() == str(tmp_path / "steps.csv")
    args = make_argument_parser().parse_args(
        ["--model_dir", str(tiny_llama_dir), "--device", "cpu", "--max_total_token_num", "512", "--max_req_total_len", "256"])
    validate_args(args, 0)
    config = ModelConfig.from_dir(tiny_llama_dir)
    sizing = plan_sizing(args, config, "cpu")
    configs = build_process_configs(args, sizing, config, plan_layout(sizing, "lightllm_test_trace", "/tmp/lightllm_test_trace"),
                                    nccl_port=29997, sampling_seed=resolve_sampling_seed(args))
    assert [rank.step_trace_path for rank in configs.ranks] == [str(tmp_path / "steps.csv")]
    # /proc exists and root may "write" there by os.access; opening the file is what fails.
    for value, message in [(str(tmp_path), "must name a file"), (str(tmp_path / "missing" / "steps.csv"), "does not exist"),
                           ("/proc/lightllm_steps.csv", "cannot be written")]:
        monkeypatch.setenv("LIGHTLLM_STEP_TRACE", value)
        with pytest.raises(ValueError, match=f"LIGHTLLM_STEP_TRACE.*{message}"):
            plan_sizing(args, config, "cpu")
