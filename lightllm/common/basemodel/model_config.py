"""Reading a Hugging Face ``config.json`` into one normalised description.

Checkpoints are written by transformers 4.x (``torch_dtype``, top-level ``rope_theta`` and
``rope_scaling``) and by 5.x (``dtype``, ``rope_parameters``), and by other tools that omit
optional keys.  Everything downstream reads :class:`ModelConfig`, never the raw dict.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from lightllm.common.basemodel.generation_defaults import (GENERATION_CONFIG_FILE, GenerationDefaultsError,
                                                          read_generation_config)
from lightllm.utils.tokenizer_files import tokenizer_eos_token_id

if TYPE_CHECKING:
    import torch

log = logging.getLogger("lightllm.model_config")

# Dtypes are kept as names here so that the processes that only plan (the launcher, the PD master)
# read a checkpoint's config without importing torch; the model code turns a name into a torch
# dtype (parse_dtype) where it makes tensors.  Spelling -> canonical name, as torch names it.
_DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}

# Bytes per element of each canonical dtype (what torch's ``dtype.itemsize`` says).
DTYPE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}

# The decoder template's MLP is SwiGLU: transformers spells its activation "silu" or "swish".
# Any other activation would run as SiLU and give wrong output, so it is refused.
SUPPORTED_HIDDEN_ACTS = ("silu", "swish")

# Attention kinds a config's ``layer_types`` may name.  Sliding layers attend to the last
# ``sliding_window`` tokens; this server runs full causal attention, which is the same
# computation while a sequence fits in the window (see :attr:`ModelConfig.context_limit`).
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
# transformers' defaults when a config.json leaves the key out.
MISTRAL_DEFAULT_SLIDING_WINDOW = 4096
QWEN_DEFAULT_SLIDING_WINDOW = 4096
QWEN_DEFAULT_MAX_WINDOW_LAYERS = 28
QWEN3_DEFAULT_HEAD_DIM = 128

# The RoPE types this server computes, and the keys of each that transformers requires in
# ``rope_scaling`` / ``rope_parameters`` beyond the type (its ``_validate_<type>_rope_parameters``;
# ``rope_theta`` and llama3's ``original_max_position_embeddings`` it fills in from the config,
# so they are optional here too).  transformers raises a bare KeyError for a missing one when it
# reads the config, which here the detokenization process did, after every process had started.
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
REQUIRED_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
}
# Types whose max_position_embeddings the factor stretches: vLLM multiplies its default context
# by the factor for every rope type but su, longrope and llama3 (and yarn, from another base).
FACTOR_SCALED_ROPE_TYPES = ("linear", "dynamic")


class ModelConfigError(ValueError):
    """The checkpoint's config.json is missing something we need or holds a bad value."""


def dtype_name(dtype: Any) -> str:
    """The canonical name (``float32``, ``bfloat16``, ``float16``) of a dtype name or torch dtype.

    Accepts the spellings of config.json and the flags (``bf16``, ``torch.float16`` ...) and
    torch dtype objects (by their printed name, so torch is never imported here).
    """
    key = str(dtype).replace("torch.", "").lower()
    if key not in _DTYPE_NAMES:
        raise ModelConfigError(f"unsupported dtype {dtype!r}; expected one of {sorted(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[key]


def dtype_itemsize(dtype: Any) -> int:
    """Bytes per element of a dtype given by name or as a torch dtype."""
    return DTYPE_ITEMSIZE[dtype_name(dtype)]


def parse_dtype(name: Optional[str]) -> Optional["torch.dtype"]:
    """Map a dtype name (``float32``, ``bf16``, ``torch.float16`` ...) to a torch dtype.

    For the code that makes tensors: it imports torch, which a launcher must not (see
    docs/EN/architecture.md); everything that only plans uses :func:`dtype_name`.
    """
    if name is None:
        return None
    canonical = dtype_name(name)
    import torch

    return getattr(torch, canonical)


@dataclass
class RopeConfig:
    """Rotary embedding parameters after merging the 4.x and 5.x spellings."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: Optional[int] = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    partial_rotary_factor: float = 1.0

    @property
    def length_dependent(self) -> bool:
        """Whether a token's rotation depends on its request's length (dynamic NTK), not only its position.

        Then a key computed for one request is wrong for another of a different length, so such
        keys cannot be shared through the prefix cache.
        """
        return self.rope_type == "dynamic"


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
    # Canonical name (float32, bfloat16, float16): parse_dtype gives the torch dtype.
    dtype: str
    bos_token_id: Optional[int]
    eos_token_ids: List[int] = field(default_factory=list)
    # The window of a checkpoint with sliding-window layers, None when every layer attends to
    # the whole sequence.
    sliding_window: Optional[int] = None
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)

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
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{path} is not valid JSON: {exc}") from exc
        # Multimodal / nested configs keep the language model under text_config.
        if "text_config" in raw and "hidden_size" not in raw:
            raw = {**raw["text_config"], "model_type": raw["text_config"].get("model_type", raw.get("model_type"))}
        cfg = cls.from_dict(raw)
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
        """Normalise a config dict as transformers 4.x or 5.x writes it."""

        def need(key: str) -> Any:
            if key not in raw or raw[key] is None:
                raise ModelConfigError(f"config.json lacks required key {key!r}")
            return raw[key]

        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        model_type = str(need("model_type"))
        # transformers' defaults when the key is missing: Qwen3 fixes 128, the others derive it.
        head_dim = int(raw.get("head_dim") or (QWEN3_DEFAULT_HEAD_DIM if model_type == "qwen3" else hidden // heads))
        if heads % kv_heads != 0:
            raise ModelConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        num_layers = int(need("num_hidden_layers"))
        hidden_act = str(raw.get("hidden_act") or "silu")
        if hidden_act not in SUPPORTED_HIDDEN_ACTS:
            raise ModelConfigError(
                f"hidden_act {hidden_act!r} is not supported: the MLP runs SwiGLU, whose activation is silu"
            )
        if raw.get("mlp_bias"):
            raise ModelConfigError("mlp_bias is true: biases on the MLP projections are not supported")
        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(raw.get("max_position_embeddings") or 2048),
            rms_norm_eps=float(raw.get("rms_norm_eps") or 1e-6),
            rope=_read_rope(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2's q/k/v biases come with the architecture (Qwen2Model), not with this key.
            attention_bias=bool(raw.get("attention_bias", False)),
            hidden_act=hidden_act,
            dtype=dtype_name(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_id_list(raw.get("eos_token_id"), "config.json: eos_token_id"),
            sliding_window=_read_sliding_window(raw, model_type, num_layers),
            raw=raw,
        )


def _as_id_list(value: Any, name: str) -> List[int]:
    """Token ids written as one id or a list (``name`` says where, for the error)."""
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ModelConfigError(f"{name} must be a token id or a list of token ids, got {value!r}")
    return list(values)


def _read_sliding_window(raw: Dict[str, Any], model_type: str, num_layers: int) -> Optional[int]:
    """The sliding window some layer attends with, or None when every layer attends fully.

    As transformers reads it: Qwen2 / Qwen3 slide only with ``use_sliding_window``, on the layers
    ``layer_types`` names (or, without it, the layers from ``max_window_layers`` on); Mistral
    slides on every layer unless ``sliding_window`` is null (4096 when the key is missing). Llama's
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
    if model_type == "mistral":
        window = raw.get("sliding_window", MISTRAL_DEFAULT_SLIDING_WINDOW)
        sliding = True  # transformers' Mistral slides on every layer whatever layer_types says
    elif model_type in ("qwen2", "qwen3"):
        window = raw.get("sliding_window", QWEN_DEFAULT_SLIDING_WINDOW)
        if not raw.get("use_sliding_window", False):
            return None
        if layer_types is not None:
            sliding = "sliding_attention" in layer_types
        else:
            sliding = int(raw.get("max_window_layers", QWEN_DEFAULT_MAX_WINDOW_LAYERS)) < num_layers
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


def _rope_number(params: Dict[str, Any], key: str, source: str) -> float:
    """``params[key]`` as a float; a value that is no number is refused naming ``source.key``."""
    value = params[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelConfigError(f"config.json: {source}.{key} must be a number, got {value!r}")
    return float(value)


def _read_rope(raw: Dict[str, Any]) -> RopeConfig:
    """The rotary parameters as transformers reads them for Llama, Mistral, Qwen2 and Qwen3.

    5.x keeps theta and scaling together in ``rope_parameters``, 4.x has ``rope_theta`` +
    ``rope_scaling``.  A config with both (a 5.x config someone added ``rope_scaling`` to, as
    model cards say to for YaRN or linear scaling) uses ``rope_scaling`` whole, as transformers
    does; the theta then comes from it, else from the top-level ``rope_theta``, else 10000.
    The type may be spelled ``rope_type`` or (4.x) ``type``.  A key the type requires
    (:data:`REQUIRED_ROPE_KEYS`) that is missing or not a number is refused here, naming it,
    where transformers raises a bare KeyError reading the config (or a TypeError computing with a
    value that is no number).
    """
    scaling = dict(raw.get("rope_scaling") or {})
    params = scaling or dict(raw.get("rope_parameters") or {})
    source = "rope_scaling" if scaling else "rope_parameters"
    if scaling and raw.get("rope_parameters"):
        log.info("config.json has both rope_scaling and rope_parameters: rope_scaling is used, as transformers does")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    for key in REQUIRED_ROPE_KEYS[rope_type]:
        if key not in params:
            raise ModelConfigError(
                f"config.json: {source}.{key} is missing; rope type {rope_type!r} requires "
                f"{', '.join(REQUIRED_ROPE_KEYS[rope_type])} (as transformers does)"
            )
    numbers = {key: _rope_number(params, key, source) for key in REQUIRED_ROPE_KEYS[rope_type]}
    factor = numbers.get("factor", 1.0)
    if factor <= 0:
        # transformers warns below 1 and divides by the factor: zero or less is no scaling at all.
        raise ModelConfigError(f"config.json: {source}.factor must be positive, got {params['factor']!r}")
    if factor < 1:
        log.warning("config.json: %s.factor %g is below 1 (transformers warns too): RoPE positions are compressed "
                    "and the default context shrinks to max_position_embeddings x %g", source, factor, factor)
    if rope_type == "default" and "factor" in params:
        log.warning("config.json: %s.factor is ignored with the default rope type, as transformers ignores it", source)
    original_max = params.get("original_max_position_embeddings")
    if rope_type == "llama3":
        if "original_max_position_embeddings" in params and (
                isinstance(original_max, bool) or not isinstance(original_max, int) or original_max < 1):
            raise ModelConfigError(f"config.json: {source}.original_max_position_embeddings must be a positive "
                                   f"integer, got {original_max!r} (leave it out to use max_position_embeddings)")
        if numbers["high_freq_factor"] <= numbers["low_freq_factor"]:
            log.warning("config.json: %s.high_freq_factor (%g) is not above low_freq_factor (%g); transformers "
                        "warns too and computes it as given", source, numbers["high_freq_factor"],
                        numbers["low_freq_factor"])
    partial = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0:
        # These architectures rotate the whole head: transformers ignores the factor for the
        # default rope and cannot run the scaled ones with it (its tables then miss the head's width).
        if rope_type != "default":
            raise ModelConfigError(
                f"partial_rotary_factor {partial:g} with rope type {rope_type!r}: Llama, Mistral, Qwen2 and Qwen3 rotate "
                "the whole head (transformers cannot run this config either); remove partial_rotary_factor"
            )
        log.warning("config.json sets partial_rotary_factor %g: ignored, as transformers ignores it for this "
                    "architecture (the whole head rotates)", partial)
    defaults = RopeConfig()
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=factor,
        original_max_position_embeddings=original_max,
        low_freq_factor=numbers.get("low_freq_factor", defaults.low_freq_factor),
        high_freq_factor=numbers.get("high_freq_factor", defaults.high_freq_factor),
    )
