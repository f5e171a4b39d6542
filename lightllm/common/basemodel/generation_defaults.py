"""Sampling defaults a checkpoint ships in ``generation_config.json``.

Instruction-tuned checkpoints are published with the sampling settings they were tuned for
(Qwen2.5-Instruct: ``temperature`` 0.7, ``top_p`` 0.8, ``top_k`` 20, ``repetition_penalty``
1.05).  vLLM (``--generation-config auto``, its default), transformers' ``generate()`` and
LightLLM all use them for a request that does not set the field itself; this module reads them,
torch-free, so the launcher can refuse a bad file in one line before any process starts.

The keys are the ones vLLM takes from the file (``get_diff_sampling_param``): ``temperature``,
``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``presence_penalty``,
``frequency_penalty`` and ``max_new_tokens``; every one of them is applied here too, and any other
key of the file (``num_beams``, ``typical_p`` ...) is ignored by vLLM and here alike.  Only the keys
present in the file count (transformers' class defaults, such as ``top_k`` 50, are not the
checkpoint's choice).  ``do_sample`` is LightLLM's native switch: it decides whether
a ``/generate`` request without ``do_sample`` samples at all; the OpenAI endpoints ignore it, as
vLLM does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Dict, Optional

from lightllm.common.sampling.sampling_params import SAMPLING_RANGES, SamplingParamError, SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"
# --generation_config values besides a directory.
GENERATION_CONFIG_AUTO = "auto"
GENERATION_CONFIG_NONE = "none"


class GenerationDefaultsError(ValueError):
    """A ``generation_config.json`` that cannot be used (the message names the file and key)."""


@dataclass(frozen=True)
class GenerationDefaults:
    """The sampling fields a request inherits when it does not set them (None: not set by the file)."""

    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    max_new_tokens: Optional[int] = None
    do_sample: Optional[bool] = None
    # The file they came from ("" when none was read), for the start-up log.
    source: str = ""

    def sampling_fields(self) -> Dict[str, Any]:
        """The SamplingParams fields the file sets (``max_new_tokens`` and ``do_sample`` excluded)."""
        return {name: getattr(self, name) for name in SAMPLING_KEYS if getattr(self, name) is not None}

    def describe(self) -> str:
        """One line for the start-up log: what requests inherit, and from where."""
        values = {field.name: getattr(self, field.name) for field in fields(self) if field.name != "source"}
        # do_sample is /generate's switch only (the OpenAI endpoints sample by temperature, as vLLM).
        given = ", ".join(f"{name}={value}" + (" (/generate)" if name == "do_sample" else "")
                          for name, value in values.items() if value is not None)
        if not given:
            return "requests without sampling fields use the server's defaults (no generation config values)"
        return f"requests without their own value use {given} (from {self.source})"


# The SamplingParams fields a file may default (vLLM's list, less max_new_tokens, which is resolved
# against the context by the caller).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")


def _number(path: Path, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise GenerationDefaultsError(f"{path}: {key} must be a finite number, got {value!r}")
    return float(value)


def _integer(path: Path, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise GenerationDefaultsError(f"{path}: {key} must be an integer, got {value!r}")
    return value


def _checked(path: Path, raw: Dict[str, Any]) -> Dict[str, Any]:
    """The keys this server uses, each checked against the range a request may send."""
    values: Dict[str, Any] = {}
    if raw.get("temperature") is not None:
        values["temperature"] = _number(path, "temperature", raw["temperature"])
        if values["temperature"] < 0:
            raise GenerationDefaultsError(f"{path}: temperature must be >= 0, got {raw['temperature']!r}")
    if raw.get("top_p") is not None:
        values["top_p"] = _number(path, "top_p", raw["top_p"])
        if not 0 < values["top_p"] <= 1:
            raise GenerationDefaultsError(f"{path}: top_p must be in (0, 1], got {raw['top_p']!r}")
    if raw.get("top_k") is not None:
        values["top_k"] = _integer(path, "top_k", raw["top_k"])
        if values["top_k"] < -1:
            raise GenerationDefaultsError(f"{path}: top_k must be -1 or 0 (off) or >= 1, got {raw['top_k']!r}")
    if raw.get("min_p") is not None:
        values["min_p"] = _number(path, "min_p", raw["min_p"])
        if not 0 <= values["min_p"] <= 1:
            raise GenerationDefaultsError(f"{path}: min_p must be in [0, 1], got {raw['min_p']!r}")
    if raw.get("repetition_penalty") is not None:
        values["repetition_penalty"] = _number(path, "repetition_penalty", raw["repetition_penalty"])
        if values["repetition_penalty"] <= 0:
            raise GenerationDefaultsError(f"{path}: repetition_penalty must be > 0, got {raw['repetition_penalty']!r}")
    for key in ("presence_penalty", "frequency_penalty"):
        if raw.get(key) is not None:
            values[key] = _number(path, key, raw[key])
            # The OpenAI range every request is held to (vLLM would fail each request inheriting
            # a value outside it; refusing at start names the file instead).
            bounds = SAMPLING_RANGES[key]
            if not bounds.holds(values[key]):
                raise GenerationDefaultsError(f"{path}: {key} must be {bounds.describe()}, got {raw[key]!r}")
    if raw.get("max_new_tokens") is not None:
        values["max_new_tokens"] = _integer(path, "max_new_tokens", raw["max_new_tokens"])
        if values["max_new_tokens"] < 1:
            raise GenerationDefaultsError(f"{path}: max_new_tokens must be >= 1, got {raw['max_new_tokens']!r}")
    if raw.get("do_sample") is not None:
        if not isinstance(raw["do_sample"], bool):
            raise GenerationDefaultsError(f"{path}: do_sample must be true or false, got {raw['do_sample']!r}")
        values["do_sample"] = raw["do_sample"]
    # Beyond the ranges, what a request's record can store (a float32 temperature, an int32 top_k):
    # the same check every request's values pass, so a default can never fail a request.
    try:
        SamplingParams(**{key: values[key] for key in (*SAMPLING_KEYS, "max_new_tokens") if key in values})
    except SamplingParamError as exc:
        raise GenerationDefaultsError(f"{path}: {exc}") from None
    return values


def read_generation_config(directory: str | Path) -> Dict[str, Any]:
    """``directory``'s ``generation_config.json`` as a JSON object ({} when there is no such file)."""
    path = Path(directory) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GenerationDefaultsError(f"{path} is not valid JSON: {exc}") from exc
    except RecursionError:
        raise GenerationDefaultsError(f"{path} is not valid JSON (nested too deep to read)") from None
    if not isinstance(raw, dict):
        raise GenerationDefaultsError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def read_generation_defaults(directory: str | Path) -> GenerationDefaults:
    """The defaults in ``directory``'s ``generation_config.json`` (none when it has no such file)."""
    raw = read_generation_config(directory)
    if not raw:
        return GenerationDefaults()
    path = Path(directory) / GENERATION_CONFIG_FILE
    return GenerationDefaults(**_checked(path, raw), source=str(path))


def resolve_generation_defaults(flag: str, model_dir: str | Path) -> GenerationDefaults:
    """What ``--generation_config`` selects: ``auto`` (the checkpoint's file), ``none``, or a directory's file."""
    if flag == GENERATION_CONFIG_NONE:
        return GenerationDefaults()
    if flag == GENERATION_CONFIG_AUTO:
        return read_generation_defaults(model_dir)
    directory = Path(flag)
    if not (directory / GENERATION_CONFIG_FILE).is_file():
        raise GenerationDefaultsError(f"--generation_config {flag}: expected 'auto', 'none' or a directory holding "
                                      f"{GENERATION_CONFIG_FILE}, and {directory / GENERATION_CONFIG_FILE} is no file")
    return read_generation_defaults(directory)
