"""glibc malloc settings of the children, idle trimming, and the KV budget rule."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.server.argument_error import ArgumentError
from lightllm.server.launch.args_check import validate_args
from lightllm.server.launch.arg_parser import make_argument_parser
from lightllm.server.launch.kv_budget import GIB, KVBudget, activation_bytes, plan_kv_budget, weights_bytes
from lightllm.server.launch.plan import build_process_configs, plan_layout, resolve_sampling_seed
from lightllm.server.launch.sizing import plan_sizing, resolve_max_req_total_len
from lightllm.utils.envs_utils import DEFAULT_IDLE_MALLOC_TRIM_SECONDS, ENV_VARS, idle_malloc_trim_seconds
from lightllm.utils.malloc_tuning import (
    IdleMallocTrimmer,
    apply_child_malloc_env,
    child_malloc_env,
    malloc_trim,
)


def test_children_get_a_high_mmap_threshold_but_a_moderate_trim_threshold():
    env = child_malloc_env()
    assert int(env["MALLOC_MMAP_THRESHOLD_"]) == 1 << 32
    assert 0 < int(env["MALLOC_TRIM_THRESHOLD_"]) <= 1 << 30  # a peak is given back, not kept forever
    environ = {"MALLOC_TRIM_THRESHOLD_": "1234"}
    assert apply_child_malloc_env(environ) == {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": "1234"}


def test_idle_trimmer_trims_once_per_idle_period_after_work():
    now = [0.0]
    calls = []
    trimmer = IdleMallocTrimmer(1.0, clock=lambda: now[0], trim=lambda: calls.append(now[0]) or True)
    assert not trimmer.idle()  # no work yet: nothing to give back
    trimmer.busy()
    now[0] = 0.5
    assert not trimmer.idle()  # not idle long enough
    now[0] = 1.2
    assert trimmer.idle() and calls == [1.2]
    now[0] = 5.0
    assert not trimmer.idle()  # still the same idle period
    trimmer.busy()
    now[0] = 6.5
    assert trimmer.idle() and trimmer.trims == 2
    never = IdleMallocTrimmer(math.inf, clock=lambda: now[0], trim=lambda: calls.append(-1) or True)
    never.busy()
    now[0] = 1e9
    assert not never.idle() and calls == [1.2, 6.5]
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="idle_seconds must be > 0"):
            IdleMallocTrimmer(bad)


def test_the_idle_trim_waits_out_pauses_between_bursts_by_default(monkeypatch):
    monkeypatch.delenv("LIGHTLLM_IDLE_MALLOC_TRIM", raising=False)
    # Bursts a few seconds apart must keep their working set (docs/EN/memory.md).
    assert idle_malloc_trim_seconds() == DEFAULT_IDLE_MALLOC_TRIM_SECONDS >= 10
    assert "default 30" in ENV_VARS["LIGHTLLM_IDLE_MALLOC_TRIM"]
    monkeypatch.setenv("LIGHTLLM_IDLE_MALLOC_TRIM", "2.5")
    assert idle_malloc_trim_seconds() == 2.5
    monkeypatch.setenv("LIGHTLLM_IDLE_MALLOC_TRIM", "0")
    assert idle_malloc_trim_seconds() == math.inf  # never
    monkeypatch.setenv("LIGHTLLM_IDLE_MALLOC_TRIM", "1e6")
    assert idle_malloc_trim_seconds() == 1e6
    # 1e9: past the longest wait a poll can take, as for every seconds flag.
    for value in ("off", "-1", "inf", "nan", "1e9"):
        monkeypatch.setenv("LIGHTLLM_IDLE_MALLOC_TRIM", value)
        with pytest.raises(ValueError, match="LIGHTLLM_IDLE_MALLOC_TRIM must be a number of seconds from 0 "
                                             r"\(never trim\) to 1e6"):
            idle_malloc_trim_seconds()


def test_the_idle_trim_setting_reaches_every_rank(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("LIGHTLLM_IDLE_MALLOC_TRIM", "7")
    args = make_argument_parser().parse_args(
        ["--model_dir", str(tiny_llama_dir), "--tp", "2", "--device", "cpu", "--max_total_token_num", "512",
         "--max_req_total_len", "256"])
    validate_args(args, 0)
    config = ModelConfig.from_dir(tiny_llama_dir)
    sizing = plan_sizing(args, config, "cpu")
    configs = build_process_configs(args, sizing, config, plan_layout(sizing, "lightllm_test_trim", "/tmp/lightllm_test_trim"),
                                    nccl_port=29998, sampling_seed=resolve_sampling_seed(args))
    assert [rank.idle_malloc_trim_seconds for rank in configs.ranks] == [7.0, 7.0]
    monkeypatch.setenv("LIGHTLLM_IDLE_MALLOC_TRIM", "soon")
    with pytest.raises(ValueError, match="LIGHTLLM_IDLE_MALLOC_TRIM"):
        plan_sizing(args, config, "cpu")  # refused at start-up, not when the rank first idles


def test_malloc_trim_runs_on_glibc():
    assert malloc_trim() in (True, False)  # False only where libc has no malloc_trim


def test_budget_is_never_negative_and_follows_the_rule():
    budget = KVBudget(available=10 * GIB, weights=2 * GIB, reserve=3 * GIB, mem_fraction=0.5)
    assert budget.kv_bytes == int(2.5 * GIB)
    assert "reserve 3.00" in budget.describe()
    assert KVBudget(available=GIB, weights=GIB, reserve=GIB, mem_fraction=0.9).kv_bytes == 0


def test_weights_are_counted_at_the_serving_dtype(tiny_llama_dir, tmp_path):
    # From the headers: the tensors' data, without the header itself.
    data = sum(t.numel() * t.element_size() for t in load_file(tiny_llama_dir / "model.safetensors").values())
    assert weights_bytes(str(tiny_llama_dir), torch.float32) == data
    assert weights_bytes(str(tiny_llama_dir), "bfloat16") == data // 2
    # Stored in bfloat16 while config.json says float32: the weights' own dtype counts (it was
    # config.json's, so a float32 serving estimate was half the memory the weights take).
    model_dir = tmp_path / "bf16"
    shutil.copytree(tiny_llama_dir, model_dir)
    tensors = {name: t.to(torch.bfloat16) for name, t in load_file(model_dir / "model.safetensors").items()}
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    assert ModelConfig.from_dir(model_dir).dtype == "float32"
    assert weights_bytes(str(model_dir), torch.float32) == data


def test_activation_estimate_grows_with_the_batch_and_shrinks_with_tp(tiny_llama_dir):
    config = ModelConfig.from_dir(tiny_llama_dir)
    small = activation_bytes(config, 1, 256, 256, 1024, 16)
    assert activation_bytes(config, 1, 2048, 1024, 1024, 16) > small
    assert activation_bytes(config, 2, 256, 256, 1024, 16) < small


def _budget(tiny_llama_dir, device="cpu", reserved=None, tp=1):
    return plan_kv_budget(
        device=device, config=ModelConfig.from_dir(tiny_llama_dir), model_dir=str(tiny_llama_dir),
        serving_dtype=torch.float32, tp=tp, mem_fraction=0.9, reserved_memory_gb=reserved,
        batch_max_tokens=2048, chunk_tokens=1024, max_req_total_len=4096, max_batch_rows=256,
    )


def test_cpu_reserve_covers_processes_activations_and_a_share_of_the_machine(tiny_llama_dir):
    budget = _budget(tiny_llama_dir)
    assert budget.reserve > 1.5 * GIB  # three children at 0.5 GiB each, before activations and the machine share
    assert _budget(tiny_llama_dir, tp=2).reserve > budget.reserve
    explicit = _budget(tiny_llama_dir, reserved=1.5)
    assert explicit.reserve == int(1.5 * GIB) and explicit.kv_bytes > budget.kv_bytes


def test_reserved_memory_flag_is_validated_and_used_by_sizing(tiny_llama_dir):
    parser = make_argument_parser()
    for value in ("-1", "1e300", "1000001"):
        # 1e300 is finite, but times a GiB it overflowed to infinity: a traceback at start.
        with pytest.raises(ArgumentError, match=r"--reserved_memory_gb must be in \[0, 1e\+06\] GiB"):
            validate_args(parser.parse_args(["--model_dir", "m", "--reserved_memory_gb", value]))
    for value in ("-1", "1e308"):
        with pytest.raises(ArgumentError, match=r"--prompt_chars_per_token must be 0 \(the check off\) or in \[1, 1e\+06\]"):
            validate_args(parser.parse_args(["--model_dir", "m", "--prompt_chars_per_token", value]))
    validate_args(parser.parse_args(["--model_dir", "m", "--prompt_chars_per_token", "1e6", "--reserved_memory_gb", "1e6"]))
    config = ModelConfig.from_dir(tiny_llama_dir)
    args = parser.parse_args(["--model_dir", str(tiny_llama_dir), "--reserved_memory_gb", "100000"])
    with pytest.raises(ArgumentError, match="--reserved_memory_gb"):
        plan_sizing(args, config, "cpu")  # the reserve leaves nothing for the KV cache
    args.reserved_memory_gb = 0.0
    assert plan_sizing(args, config, "cpu").max_total_token_num >= config.max_position_embeddings


@pytest.mark.parametrize(
    "flags, driver",
    [
        (["--chunked_prefill_size", "100000"], "--chunked_prefill_size or --max_req_total_len"),
        (["--running_max_req_size", "100000000", "--disable_mixed_batches"], "--running_max_req_size"),
        (["--batch_max_tokens", "30000000"], "--batch_max_tokens / --chunked_prefill_size"),
    ],
)
def test_a_reserve_eaten_by_the_activation_estimate_names_the_flag_behind_it(tiny_llama_dir, flags, driver):
    config = ModelConfig.from_dir(tiny_llama_dir)
    args = make_argument_parser().parse_args(["--model_dir", str(tiny_llama_dir), "--max_req_total_len", "4096", *flags])
    with pytest.raises(ArgumentError, match="estimated activations of one forward") as refused:
        plan_sizing(args, config, "cpu")
    assert f"driven by {driver}: lower it, or set --reserved_memory_gb" in str(refused.value)


def test_without_chunks_the_refusal_names_no_chunk_size(tiny_llama_dir):
    # --chunked_prefill_size is refused beside --disable_chunked_prefill, so it is no remedy there.
    config = ModelConfig.from_dir(tiny_llama_dir)
    args = make_argument_parser().parse_args(["--model_dir", str(tiny_llama_dir), "--max_req_total_len", "400000",
                                              "--disable_chunked_prefill"])
    with pytest.raises(ArgumentError, match="estimated activations of one forward") as refused:
        plan_sizing(args, config, "cpu")
    assert ("driven by --max_req_total_len (with --disable_chunked_prefill a prompt runs whole; --batch_max_tokens "
            "follows it): lower it" in str(refused.value))
    assert "--chunked_prefill_size" not in str(refused.value)


def test_a_kv_cache_larger_than_memory_is_refused_before_any_process_starts(tiny_llama_dir):
    config = ModelConfig.from_dir(tiny_llama_dir)
    args = make_argument_parser().parse_args(["--model_dir", str(tiny_llama_dir), "--max_total_token_num", str(10**12)])
    with pytest.raises(ArgumentError, match=r"--max_total_token_num 1000000000000 needs .* GiB of KV cache, more than"):
        plan_sizing(args, config, "cpu")
    with pytest.raises(ArgumentError, match="each device has free"):
        plan_sizing(args, config, "cuda", cuda_free_bytes=GIB)
    args.max_total_token_num = 8192
    assert plan_sizing(args, config, "cpu").max_total_token_num == 8192


def test_a_step_budget_beyond_the_kv_cache_is_refused(tiny_llama_dir):
    # The planner cut every step to the cache: the flag promised a budget the server never ran.
    config = ModelConfig.from_dir(tiny_llama_dir)
    parse = make_argument_parser().parse_args
    base = ["--model_dir", str(tiny_llama_dir), "--max_req_total_len", "1024", "--max_total_token_num", "4096"]
    with pytest.raises(ArgumentError, match=r"--batch_max_tokens \(8192\) exceeds the KV cache \(4096 tokens, "
                                            r"--max_total_token_num\).*give at most 4096"):
        plan_sizing(parse(base + ["--batch_max_tokens", "8192"]), config, "cpu")
    assert plan_sizing(parse(base + ["--batch_max_tokens", "4096"]), config, "cpu").batch_max_tokens == 4096
    # The default step budget (2048) follows a smaller cache down, and a default chunk follows it...
    small_kv = ["--model_dir", str(tiny_llama_dir), "--max_req_total_len", "512", "--max_total_token_num", "600"]
    small = plan_sizing(parse(small_kv), config, "cpu")
    assert (small.batch_max_tokens, small.chunked_prefill_size, small.max_total_token_num) == (600, 600, 600)
    # ...but not below the rows of a mixed step, nor below a chunk the operator typed.
    rows = plan_sizing(parse(small_kv + ["--running_max_req_size", "1000"]), config, "cpu")
    assert (rows.batch_max_tokens, rows.chunked_prefill_size) == (1000, 1000)
    typed = plan_sizing(parse(small_kv + ["--chunked_prefill_size", "800"]), config, "cpu")
    assert (typed.batch_max_tokens, typed.chunked_prefill_size) == (800, 800)
    # A budget typed at the rows' floor is taken as the default is ("give at most 600" was refused for
    # being below the 1000 rows), and the refusal names that floor.
    assert plan_sizing(parse(small_kv + ["--running_max_req_size", "1000", "--batch_max_tokens", "1000"]), config,
                       "cpu").batch_max_tokens == 1000
    with pytest.raises(ArgumentError, match=r"give at most 1000$"):
        plan_sizing(parse(small_kv + ["--running_max_req_size", "1000", "--batch_max_tokens", "1001"]), config, "cpu")
    unmixed = plan_sizing(parse(small_kv + ["--running_max_req_size", "1000", "--disable_mixed_batches"]), config, "cpu")
    assert unmixed.batch_max_tokens == 600
    assert plan_sizing(parse(small_kv[:4] + ["--max_total_token_num", "4096"]), config, "cpu").batch_max_tokens == 2048


def test_a_request_limit_past_the_trained_positions_is_warned_about(tiny_llama_dir, caplog):
    config = ModelConfig.from_dir(tiny_llama_dir)
    beyond = config.max_position_embeddings + 1
    with caplog.at_level("WARNING", logger="lightllm.sizing"):
        assert resolve_max_req_total_len(config.max_position_embeddings, config) == config.max_position_embeddings
        assert not caplog.records
        assert resolve_max_req_total_len(beyond, config) == beyond
    assert f"--max_req_total_len {beyond} exceeds the checkpoint's max_position_embeddings" in caplog.text


def test_a_decode_node_sizes_its_reserve_for_decode_steps(tiny_llama_dir):
    # A decode node never prefills: its largest forward is --running_max_req_size one-token rows,
    # so it reserves no prefill chunk's activations and its KV gets that memory.
    config = ModelConfig.from_dir(tiny_llama_dir)
    common = ["--model_dir", str(tiny_llama_dir), "--device", "cpu", "--max_req_total_len", "4096",
              "--running_max_req_size", "64"]
    normal = plan_sizing(make_argument_parser().parse_args(common), config, "cpu")
    decode_args = make_argument_parser().parse_args([*common, "--run_mode", "decode", "--pd_master_ip", "127.0.0.1"])
    decode = plan_sizing(decode_args, config, "cpu")
    assert normal.batch_max_tokens == 2048 and decode.batch_max_tokens == 64
    assert decode.max_total_token_num >= normal.max_total_token_num
    decode_budget = plan_kv_budget(
        device="cpu", config=config, model_dir=str(tiny_llama_dir), serving_dtype=torch.float32, tp=1,
        mem_fraction=0.9, reserved_memory_gb=None, batch_max_tokens=64, chunk_tokens=64, max_req_total_len=4096,
        max_batch_rows=64, decode_node=True)
    assert decode_budget.reserve < _budget(tiny_llama_dir).reserve
    # A failed budget names the flags a decode node takes, not the prefill step's it refuses.
    assert decode_budget.activations.largest_driver().startswith("--running_max_req_size")
    # Its rank plans steps within that budget (the chunk, never used, fits it).
    ranks = build_process_configs(decode_args, decode, config, plan_layout(decode, "lightllm_test_dec", "/tmp/lightllm_test_dec"),
                                  nccl_port=29996, sampling_seed=resolve_sampling_seed(decode_args)).ranks
    assert (ranks[0].batch_max_tokens, ranks[0].chunked_prefill_size) == (64, 64)


def test_mixed_batches_need_a_budget_of_at_least_one_token_per_running_request(tiny_llama_dir):
    # Each decoding row takes a token of a mixed step's budget; with more rows than budget a
    # prompt got no token until the decodes finished (69 s in an outside test), so it is refused.
    config = ModelConfig.from_dir(tiny_llama_dir)
    parse = make_argument_parser().parse_args
    base = ["--model_dir", str(tiny_llama_dir), "--max_total_token_num", "8192", "--batch_max_tokens", "64"]
    with pytest.raises(ArgumentError, match=r"--batch_max_tokens \(64\) must be >= --running_max_req_size \(256\)"):
        plan_sizing(parse(base), config, "cpu")
    with pytest.raises(ArgumentError, match=r"--batch_max_tokens \(2048\) must be >= --running_max_req_size \(4096\)"):
        plan_sizing(parse(base[:4] + ["--running_max_req_size", "4096"]), config, "cpu")
    assert plan_sizing(parse(base + ["--running_max_req_size", "64"]), config, "cpu").batch_max_tokens == 64
    assert plan_sizing(parse(base + ["--disable_mixed_batches"]), config, "cpu").batch_max_tokens == 64
    # A prefill node runs no decode rows; a PD decode node no prefill.
    prefill = parse(base + ["--run_mode", "prefill", "--pd_master_ip", "127.0.0.1"])
    assert plan_sizing(prefill, config, "cpu").batch_max_tokens == 64
