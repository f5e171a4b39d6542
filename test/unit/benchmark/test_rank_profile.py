"""Reading a py-spy profile of a model rank: which phase each stack is charged to.

The stacks are written the way py-spy's raw format writes them, from the qualified names of the
server's own functions, so renaming one of them fails here instead of silently moving its time to
"other" in the profiles the docs quote.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, List

import pytest

from lightllm.benchmark.rank_profile import classify, main, read_profile
from lightllm.common.basemodel.attention.cpp_attention import CppSlotAttention
from lightllm.common.basemodel.cpp_layer_ops import CppLayerOps
from lightllm.common.basemodel.linear_kernels import OneDnnLinear
from lightllm.common.basemodel.transformer_model import DecoderOnlyTransformer
from lightllm.server.model_rank.execution.torch_executor import TorchModelExecutor
from lightllm.server.model_rank.rank_process import ModelRank
from lightllm.server.model_rank.scheduling.step_engine import StepEngine
from lightllm.server.model_rank.step_publisher import StepPublisher


def frame(function: Callable) -> str:
    return f"{function.__qualname__} (lightllm/some/file.py:12)"


ROOT = ["<module> (<string>:1)", frame(ModelRank.serve_forever)]
STEP = ROOT + [frame(StepEngine.step)]
FORWARD = STEP + [frame(StepEngine.execute), frame(StepEngine.run_decode), frame(TorchModelExecutor._forward),
                  frame(DecoderOnlyTransformer.forward)]


def raw(stack: List[str], samples: int) -> str:
    return ";".join(stack) + f" {samples}\n"


@pytest.mark.parametrize("stack, phase", [
    (FORWARD + [frame(OneDnnLinear.__call__), frame(OneDnnLinear.unpadded), "OpOverloadPacket.__call__ (torch/_ops.py:1279)"],
     "forward: projections"),
    (FORWARD + [frame(CppSlotAttention.forward)], "forward: attention"),
    (FORWARD + [frame(CppSlotAttention._prefill)], "forward: attention"),
    (FORWARD + [frame(CppSlotAttention.prepare)], "forward: attention metadata"),
    (FORWARD + [frame(CppLayerOps.add_rms_norm)], "forward: norms, activations, rotary"),
    (FORWARD + ["embedding (torch/nn/functional.py:2615)"], "forward: embedding"),
    (FORWARD + ["view (torch/_tensor.py:1)"], "forward: other"),
    (STEP + [frame(StepEngine.execute), frame(StepEngine.run_decode), frame(TorchModelExecutor._sample)], "step: sampling"),
    (STEP + [frame(StepEngine.execute), frame(StepEngine.run_decode), frame(StepEngine.take_results)],
     "step: execute, outside the forward (batch set-up, KV slots, results)"),
    (STEP + [frame(StepEngine.order)], "step: order"),
    (ROOT + [frame(StepPublisher.publish)], "between steps: publishing"),
    (ROOT + [frame(ModelRank.screen)], "between steps: admission"),
    (ROOT, "between steps: other"),
    (ROOT + ["clock_nanosleep (libc.so.6)"], None),
])
def test_each_stack_is_charged_to_its_phase(stack: List[str], phase: str) -> None:
    assert classify(stack) == phase


def test_a_profile_sums_samples_per_phase_and_leaves_idle_out() -> None:
    profile = read_profile([
        raw(FORWARD + [frame(OneDnnLinear.unpadded)], 30),
        raw(FORWARD + [frame(OneDnnLinear.__call__)], 10),
        raw(FORWARD + [frame(CppSlotAttention.forward)], 10),
        raw(ROOT + ["epoll_wait (libc.so.6)"], 7),
        "\n",
    ])
    assert profile.busy == 50 and profile.idle == 7
    assert profile.rows() == [("forward: projections", 40, 0.8), ("forward: attention", 10, 0.2)]


def test_a_line_that_is_not_py_spy_raw_is_refused_with_its_number() -> None:
    with pytest.raises(ValueError, match="line 2 is not"):
        read_profile([raw(FORWARD, 3), "not a profile line\n"])


def test_the_command_line_prints_the_table(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "rank.raw"
    path.write_text(raw(FORWARD + [frame(OneDnnLinear.unpadded)], 3) + raw(STEP + [frame(StepEngine.select)], 1))
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "| forward: projections | 3 | 75.0% |" in out and "| step: select | 1 | 25.0% |" in out


@pytest.mark.parametrize("content, message", [
    (None, "No such file"),
    ("", "no busy samples"),
    ("garbage\n", "line 1 is not"),
])
def test_the_command_line_refuses_a_missing_empty_or_malformed_profile(tmp_path: Path, content, message: str) -> None:
    path = tmp_path / "rank.raw"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit, match=message):
        main([str(path)])
