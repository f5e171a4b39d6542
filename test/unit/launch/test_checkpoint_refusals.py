"""What the launcher derives from, and refuses in, a checkpoint before any process starts: the
default context of a RoPE-scaled checkpoint (vLLM's rule), weight files the ranks could not read
(by name or by their safetensors headers), no tokenizer files (the PD master refuses those too),
and a ``--tp`` that does not divide the heads (KV heads are replicated when ``--tp`` is a multiple of them)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from checkpoint_damage_support import (copy_checkpoint, launcher_refusal, misassign_first_tensor, remove_tokenizer,
                                      shard_in_two, truncate)
from lightllm.common.basemodel.checkpoint_files import CheckpointFilesError, weight_files
from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.server.argument_error import ArgumentError
from lightllm.server.launch.arg_parser import make_argument_parser
from lightllm.server.launch.kv_budget import replicated_kv_weight_bytes
from lightllm.server.launch.sizing import plan_sizing, resolve_max_req_total_len

ROOT = Path(__file__).resolve().parents[3]


def _copy(tiny_llama_dir: Path, tmp_path: Path, name: str, **config_changes: object) -> Path:
    model_dir = tmp_path / name
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(config_changes)
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


# --- the default context of a RoPE-scaled checkpoint --------------------------------------------


@pytest.mark.parametrize("rope, context", [
    ({"rope_type": "dynamic", "factor": 2.0}, 64),
    ({"type": "linear", "factor": 4.0}, 128),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 16}, 32),
])
def test_the_default_context_of_a_scaled_rope_is_the_one_vllm_derives(tiny_llama_dir, tmp_path, rope, context):
    model_dir = _copy(tiny_llama_dir, tmp_path, "scaled", max_position_embeddings=32, rope_scaling=rope)
    config = ModelConfig.from_dir(model_dir)
    assert resolve_max_req_total_len(None, config) == context
    args = make_argument_parser().parse_args(["--model_dir", str(model_dir), "--max_total_token_num", "4096"])
    assert plan_sizing(args, config, "cpu").max_req_total_len == context


def test_an_explicit_limit_still_wins_and_is_warned_about_only_past_the_scaled_context(tiny_llama_dir, tmp_path,
                                                                                       caplog):
    model_dir = _copy(tiny_llama_dir, tmp_path, "dynamic", max_position_embeddings=32,
                      rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    config = ModelConfig.from_dir(model_dir)
    with caplog.at_level("WARNING", logger="lightllm.sizing"):
        assert resolve_max_req_total_len(16, config) == 16
        assert resolve_max_req_total_len(64, config) == 64
        assert not caplog.records
        assert resolve_max_req_total_len(200, config) == 200
    assert ("--max_req_total_len 200 exceeds the checkpoint's context of 64 tokens (max_position_embeddings 32 x "
            "dynamic rope factor 2)") in caplog.text


def test_a_sliding_window_still_refuses_a_longer_limit_on_a_scaled_rope(tiny_llama_dir, tmp_path):
    model_dir = _copy(tiny_llama_dir, tmp_path, "window", max_position_embeddings=32, sliding_window=48,
                      rope_scaling={"rope_type": "linear", "factor": 4.0})
    config = ModelConfig.from_dir(model_dir)
    assert resolve_max_req_total_len(None, config) == 48
    with pytest.raises(ArgumentError, match="exceeds the checkpoint's sliding window"):
        resolve_max_req_total_len(49, config)


# --- weight files the ranks could not read ------------------------------------------------------


def _bin_only(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    model_dir = _copy(tiny_llama_dir, tmp_path, "bin_only")
    (model_dir / "model.safetensors").rename(model_dir / "pytorch_model.bin")
    return model_dir


def _missing_shard(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    model_dir = _copy(tiny_llama_dir, tmp_path, "missing_shard")
    (model_dir / "model.safetensors").rename(model_dir / "model-00001-of-00002.safetensors")
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors"}}))
    return model_dir


def test_a_directory_with_only_pytorch_weights_names_them(tiny_llama_dir, tmp_path):
    with pytest.raises(CheckpointFilesError) as refused:
        weight_files(_bin_only(tiny_llama_dir, tmp_path))
    assert "only safetensors checkpoints are supported" in str(refused.value)
    assert "pytorch_model.bin" in str(refused.value)


def test_an_index_naming_a_missing_shard_is_refused_by_the_file_rule(tiny_llama_dir, tmp_path):
    from lightllm.common.basemodel.weight_loader import SafetensorsCheckpoint

    model_dir = _missing_shard(tiny_llama_dir, tmp_path)
    match = r"model.safetensors.index.json names 1 file\(s\) missing from .*: model-00002-of-00002.safetensors$"
    with pytest.raises(CheckpointFilesError, match=match):
        weight_files(model_dir)
    # The ranks' loader applies the same rule when it opens the checkpoint, not at its first read.
    with pytest.raises(CheckpointFilesError, match=match):
        SafetensorsCheckpoint(model_dir)


def _truncated_shard(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    model_dir = copy_checkpoint(tiny_llama_dir, tmp_path / "truncated_shard")
    shard_in_two(model_dir)
    truncate(model_dir / "model-00002-of-00002.safetensors", 1000)  # what an interrupted download leaves
    return model_dir


def _index_wrong_shard(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    model_dir = copy_checkpoint(tiny_llama_dir, tmp_path / "index_wrong_shard")
    shard_in_two(model_dir)
    misassign_first_tensor(model_dir)
    return model_dir


def _no_tokenizer(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    model_dir = copy_checkpoint(tiny_llama_dir, tmp_path / "no_tokenizer")
    remove_tokenizer(model_dir)
    return model_dir


def _cut_tokenizer_json(source: Path, tmp_path: Path) -> Path:
    model_dir = copy_checkpoint(source, tmp_path / "cut_tokenizer")
    (model_dir / "tokenizer.json").write_text("{}")  # as a download cut short, then "repaired" by hand
    return model_dir


def _garbage_tokenizer_config(source: Path, tmp_path: Path) -> Path:
    model_dir = copy_checkpoint(source, tmp_path / "garbage_config")
    (model_dir / "tokenizer_config.json").write_text("garbage")
    return model_dir


@pytest.mark.parametrize("build, message", [
    (_cut_tokenizer_json, "/cut_tokenizer/tokenizer.json cannot be read as a tokenizer (Model missing."),
    (_garbage_tokenizer_config, "/garbage_config/tokenizer_config.json is not valid JSON (Expecting value"),
    (_bin_only, "only safetensors checkpoints are supported, and it holds pytorch_model.bin"),
    (_missing_shard, "names 1 file(s) missing from"),
    (_truncated_shard, "/truncated_shard/model-00002-of-00002.safetensors is truncated: its safetensors header places "
                       "tensor data up to byte"),
    (_index_wrong_shard, "/index_wrong_shard/model.safetensors.index.json assigns tensor 'lm_head.weight' to "
                         "model-00002-of-00002.safetensors, which does not hold it"),
    (_no_tokenizer, "/no_tokenizer: looked for tokenizer.json, or a vocabulary (tokenizer.model"),
])
def test_the_launcher_refuses_unreadable_checkpoint_files_before_anything_starts(tiny_llama_dir, tmp_path, build,
                                                                                 message):
    # --max_total_token_num: the KV budget, which sizes the weights, is not what finds them.
    line = launcher_refusal(build(tiny_llama_dir, tmp_path), "--device", "cpu", "--max_total_token_num", "4096")
    assert message in line, line


def test_a_sentencepiece_only_checkpoint_without_its_packages_is_refused_before_anything_starts(
        tiny_llama_dir, tmp_path, monkeypatch):
    """The detokenizer found the missing packages after the weights loaded and every process started."""
    from lightllm.server.launch.checkpoint_reading import read_checkpoint
    from lightllm.utils import tokenizer_utils

    model_dir = copy_checkpoint(tiny_llama_dir, tmp_path / "sentencepiece_only")
    remove_tokenizer(model_dir)
    (model_dir / "tokenizer.model").write_bytes(b"\x0a\x05hello")  # only its name is read at start
    # This machine has both packages; the check is what reads their absence.
    monkeypatch.setattr(tokenizer_utils, "_importable", lambda module: module != "google.protobuf")
    args = make_argument_parser().parse_args(["--model_dir", str(model_dir)])
    with pytest.raises(ValueError, match=r"has only a SentencePiece tokenizer.model \(no tokenizer.json\), which "
                                         r"transformers reads with the protobuf package\(s\): pip install protobuf$"):
        read_checkpoint(args)


def test_the_pd_master_refuses_a_checkpoint_without_tokenizer_files(tiny_llama_dir, tmp_path):
    line = launcher_refusal(_no_tokenizer(tiny_llama_dir, tmp_path), "--run_mode", "pd_master")
    assert line.startswith(f"error: no tokenizer files in {tmp_path / 'no_tokenizer'}: looked for tokenizer.json"), line


# --- --tp must divide the heads, or replicate the KV heads it exceeds ------------------------------


def test_a_tp_beyond_the_kv_heads_is_served_and_its_replicas_are_counted_in_the_weights(tiny_llama_dir, tmp_path):
    model_dir = _copy(tiny_llama_dir, tmp_path, "mqa", num_key_value_heads=1)
    config = ModelConfig.from_dir(model_dir)
    for tp in (2, 4):
        args = make_argument_parser().parse_args(["--model_dir", str(model_dir), "--tp", str(tp)])
        assert plan_sizing(args, config, "cpu").max_total_token_num > 0
    # Every rank beyond the first keeps its own copy of the k and v rows of the one head.
    row_bytes = 2 * config.head_dim * config.hidden_size * 4
    assert replicated_kv_weight_bytes(config, 4, "float32") == config.num_hidden_layers * 3 * row_bytes
    assert replicated_kv_weight_bytes(ModelConfig.from_dir(tiny_llama_dir), 2, "float32") == 0


def test_a_tp_that_neither_divides_nor_is_a_multiple_of_the_kv_heads_is_refused(tiny_llama_dir, tmp_path):
    config = ModelConfig.from_dir(tiny_llama_dir)
    model_dir = _copy(tiny_llama_dir, tmp_path, "three_kv", num_key_value_heads=3, num_attention_heads=6)
    args = make_argument_parser().parse_args(["--model_dir", str(model_dir), "--tp", "2",
                                              "--max_total_token_num", "4096"])
    with pytest.raises(ArgumentError) as refused:
        plan_sizing(args, ModelConfig.from_dir(model_dir), "cpu")
    message = str(refused.value)
    assert message.startswith(f"--tp 2 must divide num_attention_heads (6) and intermediate_size "
                              f"({config.intermediate_size}), and divide or be a multiple of num_key_value_heads (3)")
    assert message.endswith("(failing here: num_key_value_heads)") and "\n" not in message


def test_the_tp_rule_and_the_refused_rope_types_are_documented():
    tp_help = next(a.help for a in make_argument_parser()._actions if "--tp" in a.option_strings)
    assert "num_key_value_heads" in tp_help and "a replica of one (as vLLM does)" in tp_help
    for lang in ("EN", "CN"):
        assert tp_help in (ROOT / "docs" / lang / "server_args.md").read_text()
        guide = (ROOT / "docs" / lang / "getting_started.md").read_text()
        flowing = " ".join(guide.split())  # the message may wrap across lines
        assert ("--tp 3 must divide num_attention_heads (4) and intermediate_size (128), and divide or be a "
                "multiple of num_key_value_heads (2)") in flowing
        for rope_type in ("`yarn`", "`longrope`", "`su`", "rope_scaling.factor is missing"):
            assert rope_type in guide, (lang, rope_type)
        memory = (ROOT / "docs" / lang / "memory.md").read_text()
        assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN" in memory and "get no warning" not in memory


# --- checkpoints this server would otherwise run wrongly without a word ---------------------------


@pytest.mark.parametrize("changes, message", [
    # AWQ was refused as a missing tensor, FP8 with scales as "another architecture", and float
    # weights under a quantization_config were served with the key ignored.
    ({"quantization_config": {"quant_method": "awq", "bits": 4}},
     "quantization_config (quant_method 'awq') is not supported"),
    ({"architectures": ["LlamaForSequenceClassification"]},
     "architectures ['LlamaForSequenceClassification'] names no causal language model"),
    # transformers refused it in the model rank, after every process had started.
    ({"layer_types": ["full_attention"] * 3}, "layer_types names 3 layers, but num_hidden_layers is 2"),
])
def test_a_config_the_server_cannot_run_as_written_is_refused_naming_the_key(tiny_llama_dir, tmp_path, changes,
                                                                              message):
    from lightllm.common.basemodel.model_config import ModelConfigError

    model_dir = _copy(tiny_llama_dir, tmp_path, "odd", **changes)
    with pytest.raises(ModelConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        ModelConfig.from_dir(model_dir)


def test_weights_of_more_layers_than_the_config_names_are_refused_naming_num_hidden_layers(tiny_llama_dir, tmp_path):
    import torch

    from lightllm.common.basemodel.weight_loader import CheckpointError
    from lightllm.models.registry import load_model

    layers = ModelConfig.from_dir(tiny_llama_dir).num_hidden_layers
    model_dir = _copy(tiny_llama_dir, tmp_path, "fewer", num_hidden_layers=layers - 1)
    with pytest.raises(CheckpointError, match=f"holds layers {layers - 1} to {layers - 1} beyond "
                                              f"num_hidden_layers={layers - 1}: config.json's layer count"):
        load_model(str(model_dir), dtype=torch.float32)


def test_weights_stored_in_fp8_are_refused_not_upcast(tiny_llama_dir, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from lightllm.common.basemodel.weight_loader import CheckpointError
    from lightllm.models.registry import load_model

    model_dir = _copy(tiny_llama_dir, tmp_path, "fp8")
    weights = load_file(str(model_dir / "model.safetensors"))
    name = next(key for key in weights if key.endswith("q_proj.weight"))
    weights[name] = weights[name].to(torch.float8_e4m3fn)
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"tensor '{name}' is stored as F8_E4M3: quantized or integer weights"):
        load_model(str(model_dir), dtype=torch.float32)


def test_a_tied_config_whose_head_differs_from_the_embedding_is_warned_about(tiny_llama_dir, tmp_path, caplog):
    import torch

    from lightllm.models.registry import load_model

    model_dir = _copy(tiny_llama_dir, tmp_path, "tied", tie_word_embeddings=True)
    with caplog.at_level("WARNING", logger="lightllm.model"):
        load_model(str(model_dir), dtype=torch.float32)
    assert "ties the LM head to the embedding (tie_word_embeddings), but the checkpoint's lm_head.weight differs" in \
        caplog.text


def test_architectures_naming_another_family_than_model_type_is_warned_about(tiny_llama_dir, tmp_path, caplog):
    # Served by model_type, as transformers loads it, but vLLM would build the other model.
    from lightllm.server.launch.checkpoint_reading import read_checkpoint

    model_dir = _copy(tiny_llama_dir, tmp_path, "named_mistral", architectures=["MistralForCausalLM"])
    args = make_argument_parser().parse_args(["--model_dir", str(model_dir)])
    with caplog.at_level("WARNING", logger="lightllm.server.launch.checkpoint_reading"):
        assert read_checkpoint(args)[0].model_type == "llama"
    assert ("config.json: architectures names MistralForCausalLM but model_type is 'llama': served as "
            "LlamaForCausalLM (by model_type, as transformers' AutoModelForCausalLM loads it; vLLM goes by "
            "architectures and would serve MistralForCausalLM)") in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="lightllm.server.launch.checkpoint_reading"):
        read_checkpoint(make_argument_parser().parse_args(["--model_dir", str(tiny_llama_dir)]))
    assert "architectures names" not in caplog.text


def test_the_causal_lm_classes_are_the_ones_transformers_builds():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from lightllm.models.model_types import CAUSAL_LM_CLASSES, SUPPORTED_MODEL_TYPES
    from lightllm.utils.demo_model_config import ARCHITECTURES  # utils may not import models: a copy

    assert sorted(CAUSAL_LM_CLASSES) == sorted(SUPPORTED_MODEL_TYPES)
    assert ARCHITECTURES == CAUSAL_LM_CLASSES
    for model_type, name in CAUSAL_LM_CLASSES.items():
        assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type] == name


def test_the_slow_tokenizer_refusal_is_its_line_alone(tiny_llama_dir):
    # transformers' "PyTorch was not found" advice came above it: its first import in the
    # torch-free launcher was not the quiet one.
    assert launcher_refusal(tiny_llama_dir, "--tokenizer_mode", "slow").startswith("error: --tokenizer_mode slow: transformers ")


def test_onednn_in_float16_is_refused_before_anything_starts(tiny_llama_dir):
    # The ranks refused it about 4 s after every process started.
    assert launcher_refusal(tiny_llama_dir, "--linear_backend", "onednn", "--data_type", "fp16") == (
        "error: --linear_backend onednn cannot run here: oneDNN projections take float32 or bfloat16 weights, not "
        "float16; use --linear_backend torch")
