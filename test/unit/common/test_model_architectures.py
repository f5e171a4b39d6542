"""Every model_type the registry serves against transformers (logits, greedy and two TP ranks), and
the checkpoints it must refuse rather than run wrongly: other activations, MLP biases, layer kinds
it does not implement, tensors it would leave unused, sliding windows it cannot honour."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

from lightllm.common.basemodel.batch_generator import BatchGenerator
from lightllm.common.basemodel.model_config import ModelConfig, ModelConfigError
from lightllm.common.basemodel.parallel import TensorParallelGroup
from lightllm.common.basemodel.weight_loader import CheckpointError
from lightllm.models.model_types import SUPPORTED_MODEL_TYPES
from lightllm.models.registry import MODEL_REGISTRY, load_model
from lightllm.server.argument_error import ArgumentError
from lightllm.server.launch.sizing import resolve_max_req_total_len
from lightllm.utils.free_ports import free_port

# head_dim 24 is not hidden / heads (Qwen3 and Mistral Nemo name it explicitly).
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
             intermediate_size=96, vocab_size=211, max_position_embeddings=256)
ARCHS = {
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, dict(tie_word_embeddings=True)),
    "mistral": (MistralForCausalLM, MistralConfig, dict(sliding_window=None)),
    # attention_bias puts a bias on o_proj too, which must be added once after the TP all-reduce.
    "llama_attention_bias": (LlamaForCausalLM, LlamaConfig, dict(attention_bias=True)),
}


def _save(tmp_path: Path, arch: str, **overrides) -> Path:
    model_cls, config_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**SHAPE, **extra, **overrides}))
    for param in model.parameters():
        torch.nn.init.normal_(param, mean=0.0, std=0.15)
    with torch.no_grad():  # norms away from 1, so a dropped norm changes the logits
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(1.0)
    out = tmp_path / arch
    model.save_pretrained(out)
    return out


def _prompts():
    return [[(i * 37 + j) % 200 + 3 for i in range(n)] for j, n in enumerate((5, 19, 43))]


def _our_logits(model, prompts):
    gen = BatchGenerator(model, 1024, max_sequence_length=min(256, model.config.context_limit))
    return gen.forward([gen.start(p) for p in prompts], [len(p) for p in prompts], all_logits=True)


def test_the_registry_serves_exactly_the_supported_model_types():
    assert sorted(MODEL_REGISTRY) == sorted(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_logits_and_greedy_match_transformers(tmp_path, arch):
    model_dir = _save(tmp_path, arch)
    ref = ARCHS[arch][0].from_pretrained(model_dir, dtype=torch.float32).eval()
    ours = load_model(str(model_dir), dtype=torch.float32)
    prompts = _prompts()
    expected = torch.cat([ref(torch.tensor([p])).logits[0] for p in prompts]).detach()
    assert (_our_logits(ours, prompts) - expected).abs().max().item() < 1e-4
    greedy = BatchGenerator(ours, 1024, max_sequence_length=256).greedy_generate(prompts, 12)
    for prompt, tokens in zip(prompts, greedy):
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert tokens == out[0, len(prompt):].tolist()


def _tp_worker(rank, world, port, model_dirs, prompts, out_path):
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tp = TensorParallelGroup(rank, world, torch.distributed.group.WORLD)
    logits = [_our_logits(load_model(d, dtype=torch.float32, tp=tp), prompts) for d in model_dirs]
    if rank == 0:
        torch.save(logits, out_path)
    torch.distributed.destroy_process_group()


def test_two_tensor_parallel_ranks_equal_one(tmp_path):
    # Qwen3's replicated per-head norms, and an o_proj bias that a rank-local add would double;
    # a multi-query model (one KV head) whose two ranks each keep a replica of it.
    mqa_dir = tmp_path / "mqa"
    mqa_dir.mkdir()
    model_dirs = [str(_save(tmp_path, arch)) for arch in ("qwen3", "llama_attention_bias")]
    model_dirs.append(str(_save(mqa_dir, "llama_attention_bias", num_key_value_heads=1)))
    out_path = str(tmp_path / "tp2.pt")
    mp.spawn(_tp_worker, args=(2, free_port(), model_dirs, _prompts(), out_path), nprocs=2, join=True)
    for model_dir, tp2 in zip(model_dirs, torch.load(out_path)):
        single = _our_logits(load_model(model_dir, dtype=torch.float32), _prompts())
        assert (tp2 - single).abs().max().item() < 1e-4


def test_four_ranks_over_two_kv_heads_replicate_each_head_and_match_transformers(tmp_path):
    # --tp 4 over 2 KV heads: ranks 0-1 keep KV head 0, ranks 2-3 KV head 1 (one query head each).
    model_dir = str(_save(tmp_path, "qwen3"))
    assert load_model(model_dir, dtype=torch.float32, tp=TensorParallelGroup(3, 4)).local_kv_heads == 1
    out_path = str(tmp_path / "tp4.pt")
    mp.spawn(_tp_worker, args=(4, free_port(), [model_dir], _prompts(), out_path), nprocs=4, join=True)
    (tp4,) = torch.load(out_path)
    ref = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = torch.cat([ref(torch.tensor([p])).logits[0] for p in _prompts()]).detach()
    assert (tp4 - expected).abs().max().item() < 1e-4


def test_a_sliding_window_model_matches_transformers_within_its_window(tmp_path):
    model_dir = _save(tmp_path, "mistral", sliding_window=48)
    config = ModelConfig.from_dir(model_dir)
    assert config.sliding_window == 48 and config.context_limit == 48
    ref = MistralForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ours = load_model(str(model_dir), dtype=torch.float32)
    prompt = [(i * 11) % 200 + 3 for i in range(47)]
    expected = ref(torch.tensor([prompt])).logits[0].detach()
    assert (_our_logits(ours, [prompt]) - expected).abs().max().item() < 1e-4
    # Beyond the window the model attends differently: the launcher caps requests at the window.
    assert resolve_max_req_total_len(None, config) == 48
    assert resolve_max_req_total_len(40, config) == 40
    with pytest.raises(ArgumentError, match=r"--max_req_total_len 49 exceeds the checkpoint's sliding window \(48"):
        resolve_max_req_total_len(49, config)


BASE = dict(SHAPE, model_type="llama")


@pytest.mark.parametrize(
    "raw, window",
    [
        ({**BASE, "model_type": "mistral"}, 4096),  # transformers' Mistral default
        ({**BASE, "model_type": "mistral", "sliding_window": None}, None),
        ({**BASE, "model_type": "mistral", "sliding_window": 100}, 100),
        # Llama's attention never slides, but transformers' KV cache does with the key: the window bounds
        # the context where both of its paths agree.
        ({**BASE, "model_type": "llama", "sliding_window": 100}, 100),
        ({**BASE, "model_type": "llama", "sliding_window": None}, None),
        ({**BASE, "model_type": "llama"}, None),
        ({**BASE, "model_type": "llama", "sliding_window": 100, "layer_types": ["full_attention"] * 2}, None),
        ({**BASE, "model_type": "qwen2", "sliding_window": 100}, None),  # use_sliding_window defaults off
        ({**BASE, "model_type": "qwen2", "sliding_window": 100, "use_sliding_window": False,
          "layer_types": ["full_attention", "sliding_attention"]}, None),
        ({**BASE, "model_type": "qwen2", "sliding_window": 100, "use_sliding_window": True,
          "max_window_layers": 1}, 100),
        ({**BASE, "model_type": "qwen2", "sliding_window": 100, "use_sliding_window": True,
          "max_window_layers": 2}, None),
        ({**BASE, "model_type": "qwen3", "sliding_window": 100, "use_sliding_window": True,
          "layer_types": ["full_attention", "full_attention"]}, None),
        ({**BASE, "model_type": "qwen3", "sliding_window": 100, "use_sliding_window": True,
          "layer_types": ["full_attention", "sliding_attention"]}, 100),
    ],
)
def test_the_sliding_window_is_read_as_transformers_reads_it(raw, window):
    config = ModelConfig.from_dict(raw)
    assert config.sliding_window == window
    assert config.context_limit == (256 if window is None else min(256, window))


@pytest.mark.parametrize(
    "raw, message",
    [
        ({**BASE, "hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh' is not supported"),
        ({**BASE, "mlp_bias": True}, "mlp_bias is true"),
        ({**BASE, "model_type": "qwen3", "layer_types": ["full_attention", "linear_attention"]},
         r"layer_types \['linear_attention'\] are not supported"),
        ({**BASE, "model_type": "mistral", "sliding_window": -4}, "sliding_window must be a positive integer"),
    ],
)
def test_configs_it_cannot_run_are_refused_naming_the_key(raw, message):
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_dict(raw)


def _retype(model_dir: Path, model_type: str) -> None:
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "model_type": model_type}))


def test_a_checkpoint_with_tensors_the_model_would_not_use_is_refused(tmp_path):
    # A Qwen3 checkpoint labelled llama: the per-head norms would be dropped silently.
    model_dir = _save(tmp_path, "qwen3")
    _retype(model_dir, "llama")
    with pytest.raises(CheckpointError, match=r"tensors a llama model does not use \(model\.layers\.0\.self_attn\.k_norm"):
        load_model(str(model_dir), dtype=torch.float32)
    # An extra tensor of any kind, too (here an MLP bias the config does not announce).
    other = _save(tmp_path, "mistral")
    weights = load_file(str(other / "model.safetensors"))
    weights["model.layers.1.mlp.down_proj.bias"] = torch.zeros(SHAPE["hidden_size"])
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"\(model\.layers\.1\.mlp\.down_proj\.bias\)"):
        load_model(str(other), dtype=torch.float32)


def test_a_qwen3_checkpoint_without_its_head_norms_is_refused(tmp_path):
    model_dir = _save(tmp_path, "mistral")
    _retype(model_dir, "qwen3")
    with pytest.raises(CheckpointError, match="no tensor 'model.layers.0.self_attn.q_norm.weight'"):
        load_model(str(model_dir), dtype=torch.float32)


def _add_tensors(model_dir: Path, **tensors: torch.Tensor) -> None:
    path = model_dir / "model.safetensors"
    save_file({**load_file(str(path)), **tensors}, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("arch, overrides, extra", [
    ("qwen3", {}, ["self_attn.q_proj.bias"]),  # attention_bias false: transformers ignores them
    ("mistral", {}, ["self_attn.k_proj.bias"]),  # Mistral has no attention biases at all
    ("llama_attention_bias", {"attention_bias": False}, ["self_attn.o_proj.bias"]),
], ids=["qwen3", "mistral", "llama"])
def test_biases_the_architecture_does_not_use_are_refused_not_added(tmp_path, arch, overrides, extra):
    model_dir = _save(tmp_path, arch, **overrides)
    rows = {"q_proj": 4 * 24, "k_proj": 2 * 24, "o_proj": 64}
    _add_tensors(model_dir, **{f"model.layers.0.{name}": torch.ones(rows[name.split(".")[1]]) for name in extra})
    with pytest.raises(CheckpointError, match=f"does not use \\(model\\.layers\\.0\\.{extra[0]}"):
        load_model(str(model_dir), dtype=torch.float32)


def test_a_qwen2_o_proj_bias_is_refused(tiny_qwen2_dir, tmp_path):
    import shutil
    model_dir = Path(shutil.copytree(tiny_qwen2_dir, tmp_path / "qwen2"))
    _add_tensors(model_dir, **{"model.layers.1.self_attn.o_proj.bias": torch.ones(64)})
    with pytest.raises(CheckpointError, match=r"\(model\.layers\.1\.self_attn\.o_proj\.bias\)"):
        load_model(str(model_dir), dtype=torch.float32)


def test_the_lm_head_is_read_as_transformers_reads_it(tmp_path):
    # A tied config with a different head in the file: transformers keeps the file's head.
    model_dir = _save(tmp_path, "qwen3")
    _add_tensors(model_dir, **{"lm_head.weight": torch.randn(SHAPE["vocab_size"], SHAPE["hidden_size"])})
    ref = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = _prompts()
    expected = torch.cat([ref(torch.tensor([p])).logits[0] for p in prompts]).detach()
    assert (_our_logits(load_model(str(model_dir), dtype=torch.float32), prompts) - expected).abs().max().item() < 1e-4
    # An untied config without a head: refused (transformers would start from random weights).
    untied = _save(tmp_path / "untied", "mistral")
    path = untied / "model.safetensors"
    weights = load_file(str(path))
    del weights["lm_head.weight"]
    save_file(weights, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="no tensor 'lm_head.weight' and its config does not tie"):
        load_model(str(untied), dtype=torch.float32)


def test_missing_keys_take_transformers_defaults():
    qwen3 = {key: value for key, value in {**BASE, "model_type": "qwen3"}.items() if key != "head_dim"}
    assert ModelConfig.from_dict(qwen3).head_dim == 128  # Qwen3Config's default, not hidden / heads
    llama = {key: value for key, value in BASE.items() if key != "head_dim"}
    assert ModelConfig.from_dict(llama).head_dim == 16
    qwen2 = {**BASE, "model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 1,
             "max_position_embeddings": 8192}
    assert ModelConfig.from_dict(qwen2).sliding_window == 4096  # Qwen2Config's default window
