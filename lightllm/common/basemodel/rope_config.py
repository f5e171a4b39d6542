"""Reading a config's rotary embedding parameters (RoPE) as transformers reads them.

transformers 4.x writes ``rope_theta`` + ``rope_scaling``, 5.x ``rope_parameters``; both read into
one :class:`RopeConfig`, refusing what transformers would fail on or this server cannot compute.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, Optional

from lightllm.common.basemodel.model_config_error import ModelConfigError

# The config reader's logger: these lines are about reading config.json, wherever the code lives.
log = logging.getLogger("lightllm.model_config")

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


def _rope_number(params: Dict[str, Any], key: str, source: str) -> float:
    """``params[key]`` as a float; a value that is no number is refused naming ``source.key``."""
    value = params[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelConfigError(f"config.json: {source}.{key} must be a number, got {value!r}")
    return float(value)


def read_rope(raw: Dict[str, Any], default_theta: float) -> RopeConfig:
    """The rotary parameters as transformers reads them for Llama, Mistral, Qwen2 and Qwen3.

    5.x keeps theta and scaling together in ``rope_parameters``, 4.x has ``rope_theta`` +
    ``rope_scaling``.  A config with both (a 5.x config someone added ``rope_scaling`` to, as
    model cards say to for YaRN or linear scaling) uses ``rope_scaling`` whole, as transformers
    does; the theta then comes from it, else from the top-level ``rope_theta``, else ``default_theta``
    (the architecture's default, 10000 for all four).
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
    theta = params.get("rope_theta", raw.get("rope_theta", default_theta))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < float("inf"):
        where = f"{source}.rope_theta" if "rope_theta" in params else "rope_theta"
        raise ModelConfigError(f"config.json: {where} must be a positive number, got {theta!r}")
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
        original_source = f"{source}.original_max_position_embeddings"
        given = "original_max_position_embeddings" in params
        if "original_max_position_embeddings" in raw:
            # transformers gives a top-level value priority over the rope dict's for llama3 (its
            # "Phi3 exception" in standardize_rope_params), so the top-level one is the length used.
            top_level = raw["original_max_position_embeddings"]
            if given and original_max != top_level:
                log.warning("config.json: original_max_position_embeddings %r (top level) is used for llama3 RoPE, "
                            "not %s %r, as transformers does", top_level, original_source, original_max)
            original_max, original_source, given = top_level, "original_max_position_embeddings", True
        if given and (isinstance(original_max, bool) or not isinstance(original_max, int) or original_max < 1):
            raise ModelConfigError(f"config.json: {original_source} must be a positive integer, got "
                                   f"{original_max!r} (leave it out to use max_position_embeddings)")
        if numbers["high_freq_factor"] <= numbers["low_freq_factor"]:
            log.warning("config.json: %s.high_freq_factor (%g) is not above low_freq_factor (%g); transformers "
                        "warns too and computes it as given", source, numbers["high_freq_factor"],
                        numbers["low_freq_factor"])
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial is None:
        partial = 1.0
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise ModelConfigError(f"config.json: partial_rotary_factor must be a number in (0, 1], got {partial!r}")
    partial = float(partial)
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
