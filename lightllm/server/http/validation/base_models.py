"""The strict base every HTTP request schema shares, and helpers for declaring its fields.

Every request model is strict (no coercion of strings into numbers or bools) and forbids
unknown keys, so a misspelt or internal-only field such as ``infer_high_priority`` is rejected
with a 400 that names it. The one coercion allowed is an integral float in an integer field
(``"max_tokens": 5.0`` is 5): JSON has one number type, many clients (JavaScript, anything that
round-trips through a float) write integers that way, and vLLM's lax pydantic models take them.
``5.5`` and booleans are still refused, naming the field. Validation failures become
:class:`~lightllm.server.http.errors.APIError` with ``param`` set to the dotted field path
(``messages.0.role``, ``parameters.top_p``).

A :class:`NullMeansAbsent` model reads ``"field": null`` as the field left out, on every known
field (OpenAI's SDKs and many clients send explicit nulls, and so do LightLLM clients built on
``dict`` defaults); an unknown field is still refused whatever its value.

The schemas themselves are in :mod:`lightllm.server.http.openai.openai_models`,
:mod:`lightllm.server.http.openai.chat_completion_request` and
:mod:`lightllm.server.http.native_models`; the checks that need the served model (vocabulary,
context length) are in :mod:`lightllm.server.http.generation.planning`.
"""

from __future__ import annotations

import functools
import types
import typing
from typing import Any, Callable, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lightllm.common.sampling import MAX_STOP_TOKEN_IDS, STOP_SEQUENCES_BYTES, STORED_DTYPES
from lightllm.common.sampling.sampling_params import SAMPLING_RANGES

# Most choices (``n`` and ``best_of``) a request may ask for, on every endpoint.
MAX_N = 16

# What the 32-bit float rule (storage_width.check_stored_float) refuses besides the maximum: JSON
# Schema has no keyword for "0, or at least this in magnitude", so the schema says it in words
# (an exclusiveMinimum of 0 would let 1e-39 through, a minimum of the float32 tiny would refuse
# values just below it that round up to it).
FLOAT32_RULE = (f"Stored as a 32-bit float: a value other than 0 must be at least "
                f"{float(np.finfo(np.float32).tiny)!r} in magnitude (a smaller one, such as 1e-39, would "
                "become 0 or a subnormal and is refused)")


def string_or_strings_schema(limit: int) -> dict[str, Any]:
    """JSON schema of a stop field (typed ``Any``, validated by hand by :func:`stop_validator` with
    the same ``limit``), for the OpenAPI document; the byte limit of the shared-memory record
    (SamplingParams' check) has no keyword over a list, so the description states it."""
    return {"anyOf": [{"type": "string", "minLength": 1},
                      {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": limit},
                      {"type": "null"}],
            "description": f"At most {limit} non-empty strings, together at most {STOP_SEQUENCES_BYTES} bytes "
                           "JSON-encoded"}


def null_only(description: str) -> Callable[[dict[str, Any]], None]:
    """``json_schema_extra`` of an optional field whose one accepted value is null (its type stays
    ``str | None`` or the like, so another value still gets the type error or the refusal it gets)."""

    def publish(schema: dict[str, Any]) -> None:
        schema.pop("anyOf", None)
        schema.update({"type": "null", "description": description})

    return publish


def _width_maximum(name: str) -> int | float:
    dtype = STORED_DTYPES[name]
    if np.issubdtype(dtype, np.floating):
        return float(np.finfo(dtype).max)
    return int(np.iinfo(dtype).max)


def stored_bounds(name: str) -> dict[str, Any]:
    """Schema bounds of a number whose limit is the width it is stored in (and, for a float, the
    32-bit float rule in words).

    Documentation only: SamplingParams.validate enforces the limit (the one place every API
    shares), so the OpenAPI document tells fuzzers and client generators the same thing.
    """
    extra: dict[str, Any] = {"maximum": _width_maximum(name)}
    if np.issubdtype(STORED_DTYPES[name], np.floating):
        extra["description"] = FLOAT32_RULE
    return {"json_schema_extra": extra}


def sampling_bounds(name: str) -> dict[str, Any]:
    """Schema bounds of a sampling number the request hands to SamplingParams unchecked: its range
    (:data:`SAMPLING_RANGES`, the object validate checks it against) within its stored width.

    Documentation only, as :func:`stored_bounds`: the native endpoints leave the check (and its
    message) to SamplingParams, so the schema reads the bounds from the same place.
    """
    extra = stored_bounds(name)["json_schema_extra"]
    keywords = SAMPLING_RANGES[name].json_schema()
    if "maximum" in keywords:
        keywords["maximum"] = min(keywords["maximum"], extra["maximum"])
    return {"json_schema_extra": {**extra, **keywords}}


def max_tokens_field(minimum: int, description: str | None = None) -> Any:
    """An OpenAI ``max_tokens`` field: ``minimum`` is the least value the endpoint takes (0 where
    echo may ask for the prompt alone), published here and checked by the request model itself,
    whose message says the whole rule (pydantic's "ge" message would not)."""
    return Field(default=None, description=description, json_schema_extra={
        "minimum": minimum, **stored_bounds("max_new_tokens")["json_schema_extra"]})


# JSON schema keywords of a stop_token_ids list (the list itself may be null where the field is optional).
STOP_TOKEN_IDS_SCHEMA: dict[str, Any] = {
    "maxItems": MAX_STOP_TOKEN_IDS,
    "items": {"type": "integer", **SAMPLING_RANGES["stop_token_ids"].json_schema(),
              "maximum": _width_maximum("stop_token_ids")},
}


def integral(value: Any) -> Any:
    """``value`` as an int when it is a float with no fractional part (``5.0``), else unchanged.

    Non-integral, infinite and NaN floats stay floats, so the integer check that follows refuses them.
    """
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _without_none(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return tuple(arg for arg in typing.get_args(annotation) if arg is not type(None))
    return (annotation,)


@functools.cache
def _integer_fields(model: type[BaseModel]) -> tuple[tuple[str, bool], ...]:
    """``(name, is_list)`` of the fields of ``model`` typed ``int`` or ``list[int]`` (optional or not)."""
    found = []
    for name, info in model.model_fields.items():
        kinds = _without_none(info.annotation)
        if kinds == (int,):
            found.append((name, False))
        elif len(kinds) == 1 and typing.get_origin(kinds[0]) is list and typing.get_args(kinds[0]) == (int,):
            found.append((name, True))
    return tuple(found)


class StrictModel(BaseModel):
    """Base for request bodies: strict types, unknown keys rejected, integral floats taken as integers."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data: Any) -> Any:
        # Strict mode refuses 5.0 for an int; convert it here (and only where the field is an
        # integer) so the rest of validation, bounds and error names included, stays pydantic's.
        if not isinstance(data, dict):
            return data
        fields = _integer_fields(cls)
        if not any(name in data for name, _ in fields):
            return data
        data = dict(data)
        for name, is_list in fields:
            if name not in data:
                continue
            value = data[name]
            if is_list and isinstance(value, list):
                data[name] = [integral(item) for item in value]
            elif not is_list:
                data[name] = integral(value)
        return data

    def check_consistency(self) -> None:
        """Cross-field checks that pydantic field validators cannot name a param for."""


# Keywords that refuse null whatever the anyOf beside them allows (the others constrain only the
# types they name: maximum, items, propertyNames ...).
_NULL_REFUSING_KEYWORDS = frozenset({"type", "const", "enum", "allOf", "oneOf", "not", "$ref"})


def _nullable_optional_properties(schema: dict[str, Any]) -> None:
    """Mark every optional property nullable: the models drop null fields before validating."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        if name in required:
            continue
        if prop.get("type") == "null":
            continue  # a field that takes only null (suffix) says so already
        options = prop.get("anyOf")
        # A keyword beside the anyOf that null fails (a field's extra schema, "type": "array" on
        # tools) would refuse the null the anyOf allows: such a property is wrapped whole below.
        if options is not None and not _NULL_REFUSING_KEYWORDS & prop.keys():
            if {"type": "null"} not in options:
                options.append({"type": "null"})
            continue
        meta = {key: prop.pop(key) for key in ("title", "default", "description") if key in prop}
        schema["properties"][name] = {"anyOf": [prop, {"type": "null"}], **meta}


class NullMeansAbsent(StrictModel):
    """A strict request model where ``"field": null`` is the same as leaving the field out."""

    model_config = ConfigDict(json_schema_extra=_nullable_optional_properties)

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        # Only known fields: an unknown one must still reach extra="forbid" and be refused,
        # whatever its value (a null "foo" is as much a client's mistake as "foo": false).
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None or key not in cls.model_fields}
        return data


def _normalize_stop(value: Any, limit: int, name: str) -> list[str]:
    """``value`` (None, a string or a list of strings) as a list of at most ``limit`` non-empty strings."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise ValueError(f"{name} must be a string or a list of strings")
    if len(items) > limit:
        raise ValueError(f"{name} holds at most {limit} strings, got {len(items)}")
    if any(not item for item in items):
        raise ValueError(f"{name} must not contain empty strings")
    return list(items)


def stop_validator(field: str, limit: int) -> Any:
    """The field validator of a stop-strings field: always a list afterwards, errors naming ``field``."""

    def check(cls: type, value: Any) -> list[str]:
        return _normalize_stop(value, limit, field)

    return field_validator(field)(classmethod(check))
