"""Config reading (transformers 4.x and 5.x spellings), sharded checkpoints, RoPE scaling and
tensor-parallel slicing, each checked against transformers or against tp=1."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.multiprocessing as mp
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from lightllm.common.basemodel.batch_generator import BatchGenerator
from lightllm.common.basemodel.model_config import ModelConfig, ModelConfigError
from lightllm.common.basemodel.serving_dtype import parse_dtype
from lightllm.common.basemodel.parallel import TensorParallelGroup
from lightllm.common.basemodel.weight_loader import CheckpointError
from lightllm.models.registry import load_model
from lightllm.utils.free_ports import free_port

BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, vocab_size=211, max_position_embeddings=64)


def _save_hf(tmp_path, name, max_shard_size=None, **overrides):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**BASE, **overrides}))
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.1)
    out = tmp_path / name
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    return out, model.eval()


def _last_logits(model_dir, prompt):
    ours = load_model(str(model_dir), dtype=torch.float32)
    gen = BatchGenerator(ours, 512)
    return gen.forward([gen.start(prompt)], [len(prompt)], all_logits=True)


def test_reads_legacy_and_new_config_spellings():
    legacy = {**BASE, "model_type": "llama", "torch_dtype": "bfloat16", "rope_theta": 5000.0,
              "rope_scaling": {"type": "linear", "factor": 2.0}}
    new = {**BASE, "model_type": "llama", "dtype": "bfloat16",
           "rope_parameters": {"rope_theta": 5000.0, "rope_type": "linear", "factor": 2.0}}
    for raw in (legacy, new):
        cfg = ModelConfig.from_dict(raw)
        assert cfg.dtype == "bfloat16" and parse_dtype(cfg.dtype) == torch.bfloat16  # a name: torch-free
        assert cfg.rope.theta == 5000.0 and cfg.rope.rope_type == "linear" and cfg.rope.factor == 2.0
        assert cfg.head_dim == 16 and cfg.num_key_value_heads == 2


def test_config_errors_name_the_problem(tmp_path):
    with pytest.raises(ModelConfigError, match="hidden_size"):
        ModelConfig.from_dict({"model_type": "llama", "num_attention_heads": 4})
    with pytest.raises(ModelConfigError, match="unsupported rope type 'su'"):
        ModelConfig.from_dict({**BASE, "model_type": "llama", "rope_scaling": {"type": "su", "factor": 2}})
    with pytest.raises(ModelConfigError, match="no config.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "model_type": "gpt2"}))
    with pytest.raises(ModelConfigError, match="model_type 'gpt2' is not supported"):
        load_model(str(tmp_path))


def test_rope_scaling_added_to_a_5x_config_wins_over_rope_parameters_as_in_transformers(tmp_path):
    """transformers 5 writes rope_parameters into every config; a user then adding rope_scaling
    (as model cards ask for linear or YaRN scaling) gets rope_scaling in transformers."""
    model_dir, _ = _save_hf(tmp_path, "scaled")
    config_path = model_dir / "config.json"
    raw = json.loads(config_path.read_text())
    assert raw["rope_parameters"]["rope_type"] == "default"
    raw["rope_scaling"] = {"type": "linear", "factor": 4.0}
    config_path.write_text(json.dumps(raw))
    cfg = ModelConfig.from_dir(model_dir)
    assert (cfg.rope.rope_type, cfg.rope.factor, cfg.rope.theta) == ("linear", 4.0, 10000.0)
    ref = LlamaForCausalLM.from_pretrained(model_dir).eval()
    prompt = list(range(3, 40))
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0]
    assert (_last_logits(model_dir, prompt) - expected).abs().max().item() < 1e-4


def test_partial_rotary_factor_is_ignored_as_transformers_ignores_it_or_refused(tmp_path, caplog):
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    with caplog.at_level("WARNING", logger="lightllm.model_config"):
        model_dir, ref = _save_hf(tmp_path, "partial", rope_parameters=rope)
        prompt = list(range(3, 40))
        with torch.no_grad():
            expected = ref(torch.tensor([prompt])).logits[0]
        assert (_last_logits(model_dir, prompt) - expected).abs().max().item() < 1e-4
    assert "partial_rotary_factor 0.5: ignored" in caplog.text
    with pytest.raises(ModelConfigError, match="partial_rotary_factor 0.5 with rope type 'linear'"):
        ModelConfig.from_dict({**BASE, "model_type": "llama",
                               "rope_parameters": {**rope, "rope_type": "linear", "factor": 2.0}})


def test_stray_safetensors_beside_model_safetensors_are_not_read(tmp_path):
    """As transformers: model.safetensors is the model when there is no index (Mistral ships a
    consolidated.safetensors of its own names beside it); without either, a tensor in two files
    is refused."""
    from safetensors.torch import save_file

    from lightllm.common.basemodel.weight_loader import SafetensorsCheckpoint

    model_dir, ref = _save_hf(tmp_path, "stray")
    save_file({"layers.0.attention.wq.weight": torch.zeros(4, 4)}, str(model_dir / "consolidated.safetensors"))
    prompt = list(range(3, 20))
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0]
    assert (_last_logits(model_dir, prompt) - expected).abs().max().item() < 1e-4
    (model_dir / "model.safetensors").rename(model_dir / "weights.safetensors")
    save_file({"model.norm.weight": torch.zeros(64)}, str(model_dir / "consolidated.safetensors"))
    with pytest.raises(CheckpointError, match="tensor 'model.norm.weight' is in both"):
        SafetensorsCheckpoint(model_dir)


def test_sharded_checkpoint_with_index(tmp_path):
    model_dir, ref = _save_hf(tmp_path, "sharded", max_shard_size="40KB")
    assert (model_dir / "model.safetensors.index.json").is_file()
    assert len(list(model_dir.glob("*.safetensors"))) > 1
    prompt = list(range(3, 40))
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0]
    assert (_last_logits(model_dir, prompt) - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 32, "rope_theta": 500000.0},
    ],
)
def test_rope_scaling_matches_transformers(tmp_path, rope):
    model_dir, ref = _save_hf(tmp_path, rope["rope_type"], rope_parameters=rope)
    prompt = [(i * 7) % 200 + 3 for i in range(60)]
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0]
    assert (_last_logits(model_dir, prompt) - expected).abs().max().item() < 1e-4


def _tp_worker(rank, world, port, model_dir, prompts, out_path):
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tp = TensorParallelGroup(rank, world, torch.distributed.group.WORLD)
    model = load_model(model_dir, dtype=torch.float32, tp=tp)
    gen = BatchGenerator(model, 512)
    seqs = [gen.start(p) for p in prompts]
    logits = gen.forward(seqs, [len(p) for p in prompts], all_logits=True)
    greedy = BatchGenerator(model, 512).greedy_generate(prompts, 8)
    if rank == 0:
        torch.save({"logits": logits, "greedy": greedy}, out_path)
    torch.distributed.destroy_process_group()


def test_tensor_parallel_two_ranks_equal_one(tiny_llama_dir, tmp_path):
    prompts = [[5, 9, 200, 17, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    out_path = str(tmp_path / "tp2.pt")
    mp.spawn(_tp_worker, args=(2, free_port(), str(tiny_llama_dir), prompts, out_path), nprocs=2, join=True)
    tp2 = torch.load(out_path)
    single = load_model(str(tiny_llama_dir), dtype=torch.float32)
    gen = BatchGenerator(single, 512)
    seqs = [gen.start(p) for p in prompts]
    logits = gen.forward(seqs, [len(p) for p in prompts], all_logits=True)
    assert (tp2["logits"] - logits).abs().max().item() < 1e-4
    assert tp2["greedy"] == BatchGenerator(single, 512).greedy_generate(prompts, 8)


@pytest.mark.parametrize(("field", "value", "tensor", "source"), [
    ("vocab_size", 211, "model.embed_tokens.weight", "vocab_size, hidden_size"),  # an embedding padded past the config
    ("intermediate_size", 64, "mlp.gate_proj.weight", "intermediate_size, hidden_size"),
    ("num_key_value_heads", 1, "self_attn.k_proj.weight", "num_key_value_heads x head_dim, hidden_size"),
    ("head_dim", 8, "self_attn.q_proj.weight", "num_attention_heads x head_dim, hidden_size"),
])
def test_a_tensor_whose_shape_the_config_contradicts_is_refused(tmp_path, field, value, tensor, source):
    """transformers refuses these checkpoints (size mismatch); slicing the tensors to the config's
    sizes would serve another model without an error."""
    model_dir, _ = _save_hf(tmp_path, "mismatch", vocab_size=256)
    config_path = model_dir / "config.json"
    raw = json.loads(config_path.read_text())
    raw[field] = value
    config_path.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=rf"tensor '[^']*{re.escape(tensor)}' has shape .* but config.json implies .*"
                                              rf"\({re.escape(source)}\)"):
        load_model(str(model_dir), dtype=torch.float32)


def _dynamic_model(tmp_path, rope: dict, max_position_embeddings: int):
    """A random dynamic-NTK Llama with sharp attention (transformers' reference, ours loaded from it)."""
    torch.manual_seed(0)
    ref = LlamaForCausalLM(LlamaConfig(**{**BASE, "rope_parameters": rope,
                                          "max_position_embeddings": max_position_embeddings})).eval()
    with torch.no_grad():
        for param in ref.parameters():
            torch.nn.init.normal_(param, std=0.1)
        for layer in ref.model.layers:  # sharp attention, so a rotation off by a base change shows
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
    model_dir = tmp_path / "dynamic"
    ref.save_pretrained(model_dir)
    return ref, load_model(str(model_dir), dtype=torch.float32)


def test_dynamic_ntk_rope_follows_each_requests_own_length(tmp_path):
    # Dynamic NTK changes RoPE's base with the sequence length: a request past the original
    # context must rotate with its own length, not the batch's longest, and a chunked prefill
    # with the whole prompt's (as transformers computes an unchunked prompt).
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    ref, ours = _dynamic_model(tmp_path, rope, 32)
    long_prompt = [(i * 7) % 200 + 3 for i in range(61)]
    short_prompt = [(i * 5) % 200 + 3 for i in range(20)]
    with torch.no_grad():
        expected = {len(p): ref(torch.tensor([p])).logits[0] for p in (long_prompt, short_prompt)}
    gen = BatchGenerator(ours, 512)
    together = gen.forward([gen.start(long_prompt), gen.start(short_prompt)], [61, 20], all_logits=True)
    assert (together[:61] - expected[61]).abs().max().item() < 1e-4
    assert (together[61:] - expected[20]).abs().max().item() < 1e-4  # not rotated with the long one's base
    chunked = BatchGenerator(ours, 512)
    seq = chunked.start(long_prompt)
    chunked.forward([seq], [7])
    last = chunked.forward([seq], [54])
    assert (last[0] - expected[61][-1]).abs().max().item() < 1e-4
    # Greedy decoding against transformers' cached generation (each new token at its own length),
    # past the 64-token context the factor gives, as --max_req_total_len may go.
    config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        reference = ref.generate(torch.tensor([long_prompt]), generation_config=config)[0, 61:].tolist()
    assert BatchGenerator(ours, 512, max_sequence_length=256).greedy_generate([long_prompt], 6)[0] == reference


def test_dynamic_ntk_scales_from_max_position_embeddings_not_original_max(tmp_path):
    # transformers ignores original_max_position_embeddings for dynamic NTK (it scales from
    # max_position_embeddings); a 100-token prompt inside the 256-token context must match it.
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0, "original_max_position_embeddings": 64}
    ref, ours = _dynamic_model(tmp_path, rope, 256)
    for length in (40, 100, 300):
        prompt = [(i * 7) % 200 + 3 for i in range(length)]
        with torch.no_grad():
            expected = ref(torch.tensor([prompt])).logits[0]
        gen = BatchGenerator(ours, 512, max_sequence_length=512)
        got = gen.forward([gen.start(prompt)], [length], all_logits=True)
        assert (got - expected).abs().max().item() < 1e-4, length


def test_dynamic_ntk_rotates_a_generated_token_by_the_length_it_made():
    # A request prefilled again with the tokens it generated (after a pause for KV memory, or as a
    # PD continuation) must get the keys its unsplit run had: prompt tokens at the prompt's length,
    # each generated token at its own position + 1.
    from lightllm.common.basemodel.model_config import RopeConfig
    from lightllm.common.basemodel.rotary import RotaryEmbedding

    rotary = RotaryEmbedding(RopeConfig(rope_type="dynamic", factor=2.0), 16, 32, torch.device("cpu"))
    prompt_len, total = 40, 46
    whole = rotary.cos_sin(torch.arange(total), total - 1, [prompt_len], [total])
    parts = [rotary.cos_sin(torch.arange(prompt_len), prompt_len - 1, [prompt_len], [prompt_len])]
    parts += [rotary.cos_sin(torch.tensor([p]), p, [p + 1], [1]) for p in range(prompt_len, total)]
    for got, expected in zip(whole, (torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts]))):
        assert torch.equal(got, expected)
    # A request never past the original context is rotated by the plain table.
    short = rotary.cos_sin(torch.arange(20), 19, [20], [20])
    plain = RotaryEmbedding(RopeConfig(), 16, 32, torch.device("cpu")).cos_sin(torch.arange(20), 19)
    assert all(torch.equal(a, b) for a, b in zip(short, plain))
