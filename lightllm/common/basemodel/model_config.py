"""Reading a Hugging Face ``config.json`` into one normalised description.

Checkpoints are written by transformers 4.x (``torch_dtype``, top-level ``rope_theta`` and
``rope_scaling``) and by 5.x (``dtype``, ``rope_parameters``), and by other tools that omit
optional keys, which take transformers' per-architecture defaults (:mod:`.architecture_defaults`);
the RoPE keys are read by :mod:`.rope_config`.  Everything downstream reads :class:`ModelConfig`,
never the raw dict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from lightllm.common.basemodel.architecture_defaults import ArchitectureDefaults, architecture_defaults
from lightllm.common.basemodel.config_values import config_flag, config_float, config_integer
from lightllm.common.basemodel.generation_defaults import (GENERATION_CONFIG_FILE, GenerationDefaultsError,
                                                          read_generation_config)
from lightllm.common.basemodel.model_config_error import ModelConfigError
from lightllm.common.basemodel.rope_config import FACTOR_SCALED_ROPE_TYPES, RopeConfig, read_rope
from lightllm.common.basemodel.serving_dtype import DTYPE_KEYS, take_config_dtype, take_weights_dtype
from lightllm.utils.tokenizer_files import tokenizer_eos_token_id

# The decoder template's MLP is SwiGLU: transformers spells its activation "silu" or "swish".
# Any other activation would run as SiLU and give wrong output, so it is refused.
SUPPORTED_HIDDEN_ACTS = ("silu", "swish")

# Attention kinds a config's ``layer_types`` may name.  Sliding layers attend to the last
# ``sliding_window`` tokens; this server runs full causal attention, which is the same
# computation while a sequence fits in the window (see :attr:`ModelConfig.context_limit`).
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class ModelConfig:
    """Architecture facts every decoder-only model in the registry needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool
    hidden_act: str
    # What --data_type auto serves (before the CPU rule), as a canonical name (float32, bfloat16,
    # float16; parse_dtype gives the torch dtype), or None when it cannot choose (see dtype_problem);
    # read through the ``dtype`` property, which refuses then.
    auto_dtype: Optional[str]
    bos_token_id: Optional[int]
    eos_token_ids: List[int] = field(default_factory=list)
    # The window of a checkpoint with sliding-window layers, None when every layer attends to
    # the whole sequence.
    sliding_window: Optional[int] = None
    # Key -> where its value came from, for the keys config.json lacks that a shape can contradict
    # (num_key_value_heads, head_dim): an error then blames the default, not the file.
    defaulted: Dict[str, str] = field(default_factory=dict)
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)
    # Where auto_dtype came from ("config.json's torch_dtype", "the weights' safetensors headers" ...).
    dtype_source: str = ""
    # A warning for --data_type auto: the checkpoint's dtype is one this server serves in another.
    dtype_note: Optional[str] = None
    # Why --data_type auto cannot choose (one line naming config.json's key and --data_type).
    dtype_problem: Optional[str] = None

    @property
    def dtype(self) -> str:
        """The dtype ``--data_type auto`` serves (before the CPU rule); ModelConfigError when none can be chosen.

        An explicit ``--data_type`` never asks, so a checkpoint whose config names a dtype this server
        does not run is still served in the one given.
        """
        if self.auto_dtype is None:
            raise ModelConfigError(self.dtype_problem or "the checkpoint's dtype is unknown: give --data_type")
        return self.auto_dtype

    def field_label(self, key: str) -> str:
        """``key`` for an error message, with where its value came from when config.json lacks it."""
        why = self.defaulted.get(key)
        return key if why is None else f"{key} ({why})"

    @property
    def rope_context(self) -> int:
        """The context the checkpoint declares, derived as vLLM derives its default ``max_model_len``.

        ``max_position_embeddings`` x the scaling factor for ``linear`` and ``dynamic`` RoPE (their
        ``max_position_embeddings`` is the length the factor stretches), ``max_position_embeddings``
        alone for ``default`` and ``llama3`` (llama3 configs give the extended length there and the
        pretraining one in ``original_max_position_embeddings``).  Truncated to an integer, as vLLM does.
        """
        if self.rope.rope_type in FACTOR_SCALED_ROPE_TYPES:
            return int(self.max_position_embeddings * self.rope.factor)
        return self.max_position_embeddings

    @property
    def context_limit(self) -> int:
        """The longest sequence (prompt + output) this server computes exactly.

        :attr:`rope_context`, or a sliding window when it is shorter: full causal attention
        equals windowed attention only while a sequence fits in the window.
        """
        if self.sliding_window is None:
            return self.rope_context
        return min(self.rope_context, self.sliding_window)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        """Read ``config.json``; the EOS ids also gather ``generation_config.json``'s and the tokenizer's
        ``eos_token`` (vLLM stops at both: a chat fine-tune's end-of-turn token is often only the tokenizer's)."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"no config.json in model directory {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except ValueError as exc:  # JSON or UTF-8
            raise ModelConfigError(f"{path} is not valid JSON: {exc}") from None
        except RecursionError:
            raise ModelConfigError(f"{path} is not a readable config (JSON nested too deep to read)") from None
        if not isinstance(raw, dict):
            raise ModelConfigError(f"{path} must hold a JSON object, got {type(raw).__name__}")
        # Multimodal / nested configs keep the language model under text_config.
        if "text_config" in raw and "hidden_size" not in raw:
            if not isinstance(raw["text_config"], dict):
                raise ModelConfigError(f"{path}: text_config must be a JSON object, got "
                                       f"{type(raw['text_config']).__name__}")
            # The root's dtype first, as vLLM reads it (transformers 5 writes a composite config's there):
            # a root naming either key replaces both of text_config's (a root torch_dtype must not lose
            # to a text_config dtype, which reads before torch_dtype).
            text = raw["text_config"]
            root_dtype = {key: raw[key] for key in DTYPE_KEYS if raw.get(key) is not None}
            if root_dtype:
                text = {key: value for key, value in text.items() if key not in DTYPE_KEYS}
            raw = {**text, "model_type": raw["text_config"].get("model_type", raw.get("model_type")), **root_dtype}
        cfg = cls.from_dict(raw)
        if not any(raw.get(key) is not None for key in DTYPE_KEYS):
            # config.json names no dtype: the weights' (transformers' dtype="auto" and vLLM read them too).
            take_weights_dtype(cfg, model_dir)
        try:
            gen = read_generation_config(model_dir)
        except GenerationDefaultsError as exc:
            raise ModelConfigError(str(exc)) from exc
        gen_path = Path(model_dir) / GENERATION_CONFIG_FILE
        for eos in _as_id_list(gen.get("eos_token_id"), f"{gen_path}: eos_token_id"):
            if eos not in cfg.eos_token_ids:
                cfg.eos_token_ids.append(eos)
        tokenizer_eos = tokenizer_eos_token_id(model_dir)
        if tokenizer_eos is not None and 0 <= tokenizer_eos < cfg.vocab_size and tokenizer_eos not in cfg.eos_token_ids:
            cfg.eos_token_ids.append(tokenizer_eos)
        return cfg

    @classmethod
    def from_dict(cls, raw: Dict[str, Any]) -> "ModelConfig":
        """Normalise a config dict as transformers 4.x or 5.x writes it.

        A key it leaves out takes the value transformers' config class of its ``model_type`` gives
        it (:mod:`~lightllm.common.basemodel.architecture_defaults`).
        """

        def need(key: str) -> Any:
            if key not in raw or raw[key] is None:
                raise ModelConfigError(f"config.json lacks required key {key!r}")
            return raw[key]

        def need_size(key: str) -> int:
            need(key)
            return config_integer(raw, key)

        heads = need_size("num_attention_heads")
        hidden = need_size("hidden_size")
        model_type = str(need("model_type"))
        defaults = architecture_defaults(model_type)
        defaulted: Dict[str, str] = {}
        kv_heads = _kv_heads(raw, defaults, heads, defaulted)
        head_dim = _head_dim(raw, defaults, hidden, heads, defaulted)
        if heads % kv_heads != 0:
            note = f" ({defaulted['num_key_value_heads']})" if "num_key_value_heads" in defaulted else ""
            raise ModelConfigError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}{note}")
        num_layers = need_size("num_hidden_layers")
        _refuse_unservable(raw)
        if "max_position_embeddings" in raw:
            # Null too is refused: transformers' config class refuses it.
            max_positions = config_integer(raw, "max_position_embeddings")
        else:
            max_positions = defaults.max_position_embeddings
            defaulted["max_position_embeddings"] = defaults.describe("max_position_embeddings", max_positions)
        hidden_act = str(raw.get("hidden_act") or defaults.hidden_act)
        if hidden_act not in SUPPORTED_HIDDEN_ACTS:
            raise ModelConfigError(
                f"hidden_act {hidden_act!r} is not supported: the MLP runs SwiGLU, whose activation is silu"
            )
        if raw.get("mlp_bias"):
            raise ModelConfigError("mlp_bias is true: biases on the MLP projections are not supported")
        cfg = cls(
            model_type=model_type,
            vocab_size=need_size("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need_size("intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_positions,
            # 0.0 is used as written, as transformers uses it (not replaced by the default).
            rms_norm_eps=config_float(raw, "rms_norm_eps", defaults.rms_norm_eps, integers=False),
            rope=read_rope(raw, defaults.rope_theta),
            tie_word_embeddings=config_flag(raw, "tie_word_embeddings", defaults.tie_word_embeddings),
            # Qwen2's q/k/v biases come with the architecture (Qwen2Model), not with this key.
            attention_bias=config_flag(raw, "attention_bias", defaults.attention_bias),
            hidden_act=hidden_act,
            # transformers' default when config.json names none; from_dir then reads the weights'.
            auto_dtype="float32",
            dtype_source="float32, transformers' default (config.json names no dtype)",
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_id_list(raw.get("eos_token_id"), "config.json: eos_token_id"),
            sliding_window=_read_sliding_window(raw, model_type, defaults, num_layers),
            defaulted=defaulted,
            raw=raw,
        )
        take_config_dtype(cfg, raw)
        return cfg


def _kv_heads(raw: Dict[str, Any], defaults: ArchitectureDefaults, heads: int, defaulted: Dict[str, str]) -> int:
    """``num_key_value_heads`` as transformers reads it; a missing key is noted in ``defaulted``.

    Missing, it takes the architecture's default (Mistral 8, Qwen2 / Qwen3 32, Llama
    ``num_attention_heads``); null, every one of the four derives ``num_attention_heads``.
    """
    if "num_key_value_heads" in raw:
        return heads if raw["num_key_value_heads"] is None else config_integer(raw, "num_key_value_heads")
    kv_heads = heads if defaults.num_key_value_heads is None else defaults.num_key_value_heads
    defaulted["num_key_value_heads"] = defaults.describe("num_key_value_heads", kv_heads)
    return kv_heads


def _head_dim(raw: Dict[str, Any], defaults: ArchitectureDefaults, hidden: int, heads: int,
              defaulted: Dict[str, str]) -> int:
    """``head_dim`` as transformers reads it: Qwen3 fixes 128 (noted in ``defaulted``), the others
    derive it.  Null derives it too (Qwen3's config class refuses null)."""
    if raw.get("head_dim") is not None:
        return config_integer(raw, "head_dim")
    if "head_dim" in raw or defaults.head_dim is None:
        # Not noted: hidden_size / num_attention_heads is what most configs mean by leaving it out.
        return hidden // heads
    defaulted["head_dim"] = defaults.describe("head_dim", defaults.head_dim)
    return defaults.head_dim


def _as_id_list(value: Any, name: str) -> List[int]:
    """Token ids written as one id or a list (``name`` says where, for the error)."""
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ModelConfigError(f"{name} must be a token id or a list of token ids, got {value!r}")
    return list(values)


def _refuse_unservable(raw: Dict[str, Any]) -> None:
    """Refuse a config this server would otherwise run wrongly without a word: quantized weights (the
    key was never read: AWQ was refused as a missing tensor, FP8 upcast in silence) or a model that
    is no causal LM (a sequence classifier's weights were served as one)."""
    quantization = raw.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise ModelConfigError(f"quantization_config (quant_method {method!r}) is not supported: this server runs "
                               "float checkpoints (float32, float16 or bfloat16); use the unquantized checkpoint")
    architectures = raw.get("architectures")
    if isinstance(architectures, list) and architectures and not any(
            isinstance(name, str) and name.endswith("ForCausalLM") for name in architectures):
        raise ModelConfigError(f"architectures {architectures} names no causal language model (...ForCausalLM): "
                               "this server generates text with a causal LM head")


def _read_sliding_window(raw: Dict[str, Any], model_type: str, defaults: ArchitectureDefaults,
                         num_layers: int) -> Optional[int]:
    """The sliding window some layer attends with, or None when every layer attends fully.

    As transformers reads it: Qwen2 / Qwen3 slide only with ``use_sliding_window``, on the layers
    ``layer_types`` names (or, without it, the layers from ``max_window_layers`` on); Mistral
    slides on every layer unless ``sliding_window`` is null (``defaults``' window when the key is missing). Llama's
    attention never slides in transformers, but its KV cache does when the config carries a
    ``sliding_window`` (cached generation then sees only the window while a full forward sees
    everything), so such a window bounds the context too: within it both agree with this server.
    """
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        unknown = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
        if unknown:
            raise ModelConfigError(
                f"layer_types {unknown} are not supported; supported: {', '.join(SUPPORTED_LAYER_TYPES)}"
            )
        if len(layer_types) != num_layers:
            # transformers refuses it too, but in the model rank, after every process started.
            raise ModelConfigError(f"layer_types names {len(layer_types)} layers, but num_hidden_layers is {num_layers}")
    if model_type == "mistral":
        window = raw.get("sliding_window", defaults.sliding_window)
        sliding = True  # transformers' Mistral slides on every layer whatever layer_types says
    elif model_type in ("qwen2", "qwen3"):
        window = raw.get("sliding_window", defaults.sliding_window)
        if not config_flag(raw, "use_sliding_window", defaults.use_sliding_window):
            return None
        if layer_types is not None:
            sliding = "sliding_attention" in layer_types
        elif "max_window_layers" in raw:
            sliding = config_integer(raw, "max_window_layers", minimum=0) < num_layers
        else:
            sliding = defaults.max_window_layers < num_layers
    elif model_type == "llama":
        window = raw.get("sliding_window")
        # transformers' cache infers the layer kinds from the key when layer_types does not name them.
        sliding = layer_types is None or "sliding_attention" in layer_types
    else:
        return None
    if window is None or not sliding:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelConfigError(f"sliding_window must be a positive integer or null, got {window!r}")
    return window
