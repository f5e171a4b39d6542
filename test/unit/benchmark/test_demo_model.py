"""Tests for the offline demo-checkpoint generator (lightllm.utils.demo_model)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator

import jinja2
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.utils import logging as hf_logging

from lightllm.common.basemodel.batch_generator import BatchGenerator
from lightllm.models.registry import load_model
from lightllm.utils.demo_corpus import load_corpus
from lightllm.utils.demo_model import DEMO_MODEL_FILES, generate_demo_model, main
from lightllm.utils.demo_model_config import ARCHITECTURES, SIZES, check_arch, model_config
from lightllm.utils.demo_tokenizer import SPECIAL_TOKENS, train_demo_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[3]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hi."},
    {"role": "assistant", "content": "hi"},
    {"role": "user", "content": "Again?"},
]


@pytest.fixture(autouse=True)
def _quiet_transformers() -> None:
    hf_logging.disable_progress_bar()


@pytest.fixture(params=sorted(ARCHITECTURES))
def tiny_dir(request: pytest.FixtureRequest) -> Path:
    """Every tiny architecture, from the session fixtures in conftest."""
    return request.getfixturevalue(f"tiny_{request.param}_dir")


def _read_json(path: Path) -> Dict[str, object]:
    return json.loads(path.read_text(encoding="utf-8"))


def test_writes_exactly_the_documented_files(tiny_dir: Path) -> None:
    assert sorted(p.name for p in tiny_dir.iterdir()) == sorted(DEMO_MODEL_FILES)


def test_every_file_has_the_same_permissions(tiny_dir: Path) -> None:
    """The weights were owner-only (safetensors' 0600) while the other files followed the umask: a
    server running as another user (a container's) could read the tokenizer but not the weights."""
    modes = {name: (tiny_dir / name).stat().st_mode & 0o777 for name in DEMO_MODEL_FILES}
    assert len(set(modes.values())) == 1, modes


def test_same_seed_gives_identical_bytes(tmp_path: Path, tiny_qwen2_dir: Path) -> None:
    again = generate_demo_model(tmp_path / "again", arch="qwen2", size="tiny", seed=0)
    for name in DEMO_MODEL_FILES:
        assert (again / name).read_bytes() == (tiny_qwen2_dir / name).read_bytes(), name


def test_different_seed_changes_only_weights(tmp_path: Path, tiny_llama_dir: Path) -> None:
    other = generate_demo_model(tmp_path / "seed1", arch="llama", size="tiny", seed=1)
    for name in DEMO_MODEL_FILES:
        same = (other / name).read_bytes() == (tiny_llama_dir / name).read_bytes()
        assert same == (name != "model.safetensors"), name
    a, b = load_file(tiny_llama_dir / "model.safetensors"), load_file(other / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(not torch.equal(a[k], b[k]) for k in a)


def test_config_has_v5_and_legacy_keys(tiny_dir: Path) -> None:
    cfg = _read_json(tiny_dir / "config.json")
    tied = cfg["model_type"] in ("qwen2", "qwen3")
    assert cfg["architectures"] == [ARCHITECTURES[cfg["model_type"]]]
    assert cfg["dtype"] == cfg["torch_dtype"] == "float32"
    assert cfg["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    assert cfg["rope_theta"] == 10000.0
    assert cfg["tie_word_embeddings"] is tied
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["hidden_act"] == "silu"
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (
        SPECIAL_TOKENS.bos_id,
        SPECIAL_TOKENS.eos_id,
        SPECIAL_TOKENS.pad_id,
    )
    gen = _read_json(tiny_dir / "generation_config.json")
    assert gen["eos_token_id"] == [SPECIAL_TOKENS.eos_id, SPECIAL_TOKENS.im_end_id]
    assert gen["do_sample"] is False


def test_tensor_names_follow_transformers(tiny_dir: Path) -> None:
    cfg = _read_json(tiny_dir / "config.json")
    weights = load_file(tiny_dir / "model.safetensors")
    qwen2, qwen3 = cfg["model_type"] == "qwen2", cfg["model_type"] == "qwen3"
    assert ("lm_head.weight" in weights) is not (qwen2 or qwen3)
    head_dim = cfg["head_dim"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        assert weights[p + "self_attn.q_proj.weight"].shape == (cfg["num_attention_heads"] * head_dim, cfg["hidden_size"])
        assert weights[p + "self_attn.k_proj.weight"].shape == (cfg["num_key_value_heads"] * head_dim, cfg["hidden_size"])
        assert weights[p + "mlp.down_proj.weight"].shape == (cfg["hidden_size"], cfg["intermediate_size"])
        assert (p + "self_attn.v_proj.bias" in weights) is qwen2
        assert (p + "self_attn.q_norm.weight" in weights) is (p + "self_attn.k_norm.weight" in weights) is qwen3
        # Norm weights carry noise so a loader that swaps or ignores them is caught.
        ln_in, ln_post = weights[p + "input_layernorm.weight"], weights[p + "post_attention_layernorm.weight"]
        assert not torch.equal(ln_in, torch.ones_like(ln_in)) and not torch.equal(ln_in, ln_post)
    assert all(t.dtype == torch.float32 for t in weights.values())


def test_transformers_loads_the_same_weights_and_runs(tiny_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    on_disk = load_file(tiny_dir / "model.safetensors")
    state = model.state_dict()
    for name, tensor in on_disk.items():
        assert torch.equal(state[name], tensor), name
    if "lm_head.weight" not in on_disk:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    ids = tok("def add(a, b):\n    return a + b", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size) == (1, ids.shape[1], len(tok))
    assert torch.isfinite(logits).all()
    assert logits[0, -1].std().item() > 0.5  # not a flat distribution


def test_greedy_decoding_is_not_degenerate(tiny_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    ids = tok("The quick brown fox", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id)
    new_tokens = out[0, ids.shape[1] :].tolist()
    assert len(new_tokens) == 24
    assert len(set(new_tokens)) >= 6, new_tokens


def test_tokenizer_adds_bos_once_and_round_trips(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        SPECIAL_TOKENS.bos_id,
        SPECIAL_TOKENS.eos_id,
        SPECIAL_TOKENS.pad_id,
    )
    ids = tok("hi").input_ids
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok("hi", add_special_tokens=False).input_ids == ids[1:]
    text = "Hello, wörld! 日本語 🙂\n\tdef f(x): return x**2"
    assert tok.decode(tok(text).input_ids, skip_special_tokens=True) == text
    assert tok.convert_tokens_to_ids(SPECIAL_TOKENS.im_end) == SPECIAL_TOKENS.im_end_id


def test_transformers_and_raw_tokenizer_agree(tiny_dir: Path) -> None:
    # transformers 5 rebuilds the pipeline for model_type qwen2; it must match tokenizer.json.
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    raw = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    assert len(tok) == raw.get_vocab_size() == _read_json(tiny_dir / "config.json")["vocab_size"]
    texts = ["Cafe\u0301 12345 I'm  here\r\n\n  ok", "<|im_start|>user\nhey<|im_end|>\n</s>", "", "  x"]
    for text in texts:
        assert tok(text).input_ids == raw.encode(text).ids, text
        assert tok(text, add_special_tokens=False).input_ids == raw.encode(text, add_special_tokens=False).ids


def test_chat_template_renders_roles_and_generation_prompt(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<s><|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nSay hi.<|im_end|>\n"
        "<|im_start|>assistant\nhi<|im_end|>\n"
        "<|im_start|>user\nAgain?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    closed = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    assert closed.endswith("Again?<|im_end|>\n")

    ids = list(tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)["input_ids"])
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids.count(SPECIAL_TOKENS.im_end_id) == len(MESSAGES)
    assert ids == tok(text, add_special_tokens=False).input_ids


def test_chat_template_accepts_text_parts_and_rejects_unknown_roles(tiny_llama_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts, tokenize=False) == "<s><|im_start|>user\nab<|im_end|>\n"
    with pytest.raises(jinja2.exceptions.TemplateError, match="got wizard"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}], tokenize=False)


def test_chat_template_renders_tools_and_tool_calls_qwen2_style(tiny_llama_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": "1", "content": "sunny"}]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<s><|im_start|>system\nBe brief.\n\n") and text.count("Be brief.") == 1
    assert '\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        '<|im_end|>' in text
    assert text.endswith("<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")


def test_small_preset_runs_past_2k_tokens(small_llama_dir: Path) -> None:
    cfg = _read_json(small_llama_dir / "config.json")
    assert cfg["max_position_embeddings"] == 4096 and cfg["num_hidden_layers"] >= 4
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]
    weights = load_file(small_llama_dir / "model.safetensors")
    assert 2_000_000 < sum(t.numel() for t in weights.values()) < 20_000_000
    model = AutoModelForCausalLM.from_pretrained(small_llama_dir)
    ids = torch.arange(5, 5 + 2100).remainder(cfg["vocab_size"]).unsqueeze(0)
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 2100, cfg["vocab_size"]) and torch.isfinite(logits).all()


def _params_from_config(cfg: Dict[str, object]) -> int:
    """Parameter count of a demo checkpoint computed from its config.json alone."""
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q_out = cfg["num_attention_heads"] * cfg["head_dim"]
    kv_out = cfg["num_key_value_heads"] * cfg["head_dim"]
    qwen2, qwen3 = cfg["model_type"] == "qwen2", cfg["model_type"] == "qwen3"
    attn = 2 * hidden * q_out + 2 * hidden * kv_out + (q_out + 2 * kv_out if qwen2 else 0)
    attn += 2 * cfg["head_dim"] if qwen3 else 0  # per-head q and k norms
    layer = attn + 3 * hidden * inter + 2 * hidden
    embeddings = vocab * hidden * (1 if cfg["tie_word_embeddings"] else 2)
    return embeddings + cfg["num_hidden_layers"] * layer + hidden


@pytest.fixture(scope="module")
def medium_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The ~100M medium checkpoint (394 MB), generated once for this module's medium tests.

    About 5 s on a loaded 2-core machine; only the tests that need the width use it.
    """
    out = generate_demo_model(tmp_path_factory.mktemp("medium_llama"), arch="llama", size="medium", seed=0)
    yield out
    # pytest keeps the last few runs' temp dirs; do not leave 394 MB behind in each.
    shutil.rmtree(out, ignore_errors=True)


def test_medium_preset_shape_and_parameter_count(medium_llama_dir: Path) -> None:
    cfg = _read_json(medium_llama_dir / "config.json")
    shape = {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")}
    assert shape == {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4}
    assert cfg["head_dim"] == 64 and cfg["max_position_embeddings"] == 4096
    # The vocabulary is what the demo tokenizer actually trained to.
    assert cfg["vocab_size"] == Tokenizer.from_file(str(medium_llama_dir / "tokenizer.json")).get_vocab_size()
    expected = _params_from_config(cfg)
    assert 95_000_000 < expected < 105_000_000
    assert expected == SIZES["medium"].num_parameters(check_arch("llama"))
    with safe_open(str(medium_llama_dir / "model.safetensors"), framework="pt") as f:
        numels = [torch.Size(f.get_slice(name).get_shape()).numel() for name in f.keys()]
    assert sum(numels) == expected
    # fp32 on disk: 4 bytes a parameter plus a small JSON header.
    size = (medium_llama_dir / "model.safetensors").stat().st_size
    assert 4 * expected < size < 4 * expected + 100_000
    # qwen2 at the same size ties lm_head to the embedding; its count is checked from its config.
    qwen2_cfg = model_config(check_arch("qwen2"), SIZES["medium"], SPECIAL_TOKENS)
    assert _params_from_config(qwen2_cfg) == SIZES["medium"].num_parameters(check_arch("qwen2"))
    assert 75_000_000 < _params_from_config(qwen2_cfg) < expected
    for arch in ("mistral", "qwen3"):
        cfg = model_config(check_arch(arch), SIZES["medium"], SPECIAL_TOKENS)
        assert _params_from_config(cfg) == SIZES["medium"].num_parameters(check_arch(arch)), arch


def test_medium_preset_greedy_matches_transformers(medium_llama_dir: Path) -> None:
    # The width where GQA 16/4 with head_dim 64 and 1024-wide matmuls are exercised; kept to
    # two short prompts because each transformers decode step costs tens of milliseconds here.
    ours = BatchGenerator(load_model(str(medium_llama_dir), dtype=torch.float32), kv_cache_size=256, max_request_num=2)
    ref = AutoModelForCausalLM.from_pretrained(str(medium_llama_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(medium_llama_dir)
    prompts = [tok("The quick brown fox").input_ids, tok("def add(a, b):\n    return").input_ids]
    config = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id)
    for prompt, got in zip(prompts, ours.greedy_generate(prompts, max_new_tokens=8)):
        with torch.no_grad():
            expected = ref.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt) :].tolist()
        assert got == expected
        assert len(set(got)) >= 4, got  # random weights, but not stuck on one token


def test_cli_help_lists_every_size_with_shape_and_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "medium: hidden 1024, 8 layers, 16/4 heads of 64, intermediate 1792, vocab 16384" in out
    assert "98.6M params (llama), 81.8M (qwen2)" in out
    assert all(f"{name}: hidden" in out for name in SIZES)


def test_cli_writes_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "nested" / "cli"
    assert main(["--out", str(out), "--arch", "qwen2", "--size", "tiny", "--seed", "5"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert sorted(p.name for p in out.iterdir()) == sorted(DEMO_MODEL_FILES)
    assert _read_json(out / "config.json")["model_type"] == "qwen2"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--arch", "gpt2"], "--arch"),
        (["--size", "huge"], "--size"),
        (["--seed", "x"], "--seed"),
        (["--seed", "-1"], "seed"),
    ],
)
def test_cli_bad_args_give_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list, needle: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "m"), *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err and needle in err
    assert not (tmp_path / "m").exists()


def test_cli_requires_out(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2 and "--out" in capsys.readouterr().err


def test_module_entry_point_matches_api_across_processes(tmp_path: Path, tiny_llama_dir: Path) -> None:
    # A fresh interpreter has a different hash seed, so this also checks cross-process determinism.
    out = tmp_path / "sub"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "lightllm.utils.demo_model", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    for name in DEMO_MODEL_FILES:
        assert (out / name).read_bytes() == (tiny_llama_dir / name).read_bytes(), name


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"arch": "gpt2"}, "arch"),
        ({"size": "huge"}, "size"),
        ({"seed": -1}, "seed"),
        ({"seed": True}, "seed"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_api_rejects_bad_arguments(tmp_path: Path, kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        generate_demo_model(tmp_path / "m", **kwargs)
    assert not (tmp_path / "m").exists()


def test_api_rejects_out_dir_that_is_a_file(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(ValueError, match="out_dir"):
        generate_demo_model(target)


def test_tokenizer_and_corpus_validate_inputs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        train_demo_tokenizer(10)
    with pytest.raises(ValueError, match="vocab_size"):
        train_demo_tokenizer(4096, texts=["tiny corpus"])
    with pytest.raises(ValueError, match="min_chars"):
        load_corpus(root=tmp_path)
    with pytest.raises(ValueError, match="files"):
        load_corpus(files=())
