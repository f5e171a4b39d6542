"""Virtual-time cost of the model forwards a scheduling step submits.

The simulator replaces each model forward with a duration computed from the work the step
planner selected:

    prefill forward = prefill_fixed_s
                      + prefill_per_token_s   * (tokens in all chunks)
                      + prefill_attention_s   * sum(chunk_tokens * context_len_at_chunk_end)
    decode forward  = decode_fixed_s
                      + decode_per_req_s      * (decode batch size)
                      + decode_per_kv_token_s * sum(context length of each decode request)

A step that runs both pays both, in that order, exactly as the server submits a prefill forward
and then a decode forward.  The attention term grows with the context a chunk attends to, so the
late chunks of a long prompt cost more than its first chunk.

Profiles are JSON files (``profiles/*.json``) that also record where their numbers came from:
a least-squares fit of measured forwards (``fit``) or a hand derivation from published
benchmark numbers (``derivation``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Dict, Iterable, List, Tuple

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"

COEFFICIENT_NAMES: Tuple[str, ...] = (
    "prefill_fixed_s",
    "prefill_per_token_s",
    "prefill_attention_s",
    "decode_fixed_s",
    "decode_per_req_s",
    "decode_per_kv_token_s",
)

# Largest coefficient a profile may hold, in seconds (per forward, request, token or token pair).
# Real ones are milliseconds at most; an hour is already a typo, and 1e300 passed the finite
# check while one step's time (times a 1024-token chunk) and the sums of the statistics overflowed
# to inf and NaN, printed as nan and written as JSON no reader takes.  Under this cap and
# MAX_KV_TOKENS a step stays below 1e28 s, and the statistics' sums and squares stay finite.
MAX_COEFFICIENT_S = 3600.0
# Largest KV cache a profile may hold (2**40 tokens, some thousand times the largest GPU's); a
# larger integer in the file (1e200 written out) would overflow a step's attention term.
MAX_KV_TOKENS = 1 << 40


@dataclasses.dataclass(frozen=True)
class CostProfile:
    """Step-cost coefficients of one model on one machine, plus its KV capacity.

    At least one of the three prefill coefficients must be above 0 (a free prefill forward makes
    every TTFT 0 and the soak capacity infinite), and none above :data:`MAX_COEFFICIENT_S`.

    Attributes:
        name: profile name (the JSON file stem for bundled profiles).
        prefill_fixed_s: cost of launching one prefill forward, whatever its size.
        prefill_per_token_s: cost per prefill token (weights, MLP, projections).
        prefill_attention_s: cost per (chunk token x context token at the chunk's end).
        decode_fixed_s: cost of launching one decode forward.
        decode_per_req_s: cost per request in the decode batch.
        decode_per_kv_token_s: cost per context token read by a decode request.
        max_total_token_num: KV cache capacity in tokens (router admission and allocation).
        description: one line saying what the profile models.
        provenance: the ``fit`` / ``derivation`` record kept verbatim from the JSON file.
    """

    name: str
    prefill_fixed_s: float
    prefill_per_token_s: float
    prefill_attention_s: float
    decode_fixed_s: float
    decode_per_req_s: float
    decode_per_kv_token_s: float
    max_total_token_num: int
    description: str = ""
    provenance: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        for key in COEFFICIENT_NAMES:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{key} must be a finite number >= 0, got {value!r}")
            if value > MAX_COEFFICIENT_S:
                raise ValueError(f"{key} must be at most {MAX_COEFFICIENT_S:g} s, got {value!r}: step times of such "
                                 "a profile overflow the clock and the statistics (inf and NaN)")
        if not (self.prefill_fixed_s or self.prefill_per_token_s or self.prefill_attention_s):
            # Every prefill forward would take no time: every TTFT on a prefill node is 0, a
            # comparison with default divides by 0, and no soak capacity can be estimated.
            raise ValueError("prefill_fixed_s, prefill_per_token_s and prefill_attention_s are all 0: prefill "
                             "forwards would cost nothing, so every TTFT would be 0 and no capacity can be "
                             "estimated; give prefill a cost")
        if not isinstance(self.description, str):
            # Reports print it as the profile's line of text; a number there is a mistake in the file.
            raise ValueError(f"description must be a string, got {self.description!r}")
        if isinstance(self.max_total_token_num, bool) or not isinstance(self.max_total_token_num, int):
            raise ValueError(f"max_total_token_num must be an int, got {self.max_total_token_num!r}")
        if not 1 <= self.max_total_token_num <= MAX_KV_TOKENS:
            raise ValueError(f"max_total_token_num must be within [1, {MAX_KV_TOKENS}], got {self.max_total_token_num}")

    def prefill_seconds(self, chunks: Iterable[Tuple[int, int]]) -> float:
        """Duration of one prefill forward over ``chunks`` of ``(token_num, context_end)``.

        ``context_end`` is the request's KV length once the chunk is written (the chunk's end
        position).  An empty chunk list means no prefill forward runs: 0 seconds.
        """
        token_sum = 0
        attention_sum = 0
        for token_num, context_end in chunks:
            if token_num < 1 or context_end < token_num:
                raise ValueError(
                    f"chunks need token_num >= 1 and context_end >= token_num, got ({token_num}, {context_end})"
                )
            token_sum += token_num
            attention_sum += token_num * context_end
        if token_sum == 0:
            return 0.0
        return (
            self.prefill_fixed_s
            + self.prefill_per_token_s * token_sum
            + self.prefill_attention_s * attention_sum
        )

    def decode_seconds(self, batch_size: int, kv_token_sum: int) -> float:
        """Duration of one decode forward of ``batch_size`` requests reading ``kv_token_sum`` tokens.

        ``kv_token_sum`` counts every decode request's context including the token it computes.
        A batch of 0 means no decode forward runs: 0 seconds.
        """
        if batch_size < 0:
            raise ValueError(f"batch_size must be >= 0, got {batch_size}")
        if kv_token_sum < batch_size:
            raise ValueError(f"kv_token_sum must be >= batch_size ({batch_size}), got {kv_token_sum}")
        if batch_size == 0:
            return 0.0
        return self.decode_fixed_s + self.decode_per_req_s * batch_size + self.decode_per_kv_token_s * kv_token_sum

    def prefill_tokens_per_second(self, chunk_tokens: int, context_end: int) -> float:
        """Prefill throughput of back-to-back forwards of one ``chunk_tokens`` chunk (no decode)."""
        return chunk_tokens / self.prefill_seconds([(chunk_tokens, context_end)])

    def coefficients(self) -> Dict[str, float]:
        """The six cost coefficients by name."""
        return {key: float(getattr(self, key)) for key in COEFFICIENT_NAMES}

    def to_dict(self) -> Dict[str, Any]:
        """JSON form, the inverse of :meth:`from_dict`."""
        data: Dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "coefficients": self.coefficients(),
            "max_total_token_num": self.max_total_token_num,
        }
        data.update(self.provenance)
        return data

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "CostProfile":
        """Build a profile from its JSON form; keys besides the known ones become provenance."""
        if not isinstance(data, dict):
            raise ValueError(f"profile must be a JSON object, got {type(data).__name__}")
        missing = [key for key in ("name", "coefficients", "max_total_token_num") if key not in data]
        if missing:
            raise ValueError(f"profile is missing required keys: {missing}")
        coefficients = data["coefficients"]
        if not isinstance(coefficients, dict):
            raise ValueError("profile coefficients must be a JSON object")
        absent = [key for key in COEFFICIENT_NAMES if key not in coefficients]
        if absent:
            raise ValueError(f"profile coefficients are missing: {absent}")
        unknown = sorted(set(coefficients) - set(COEFFICIENT_NAMES))
        if unknown:
            raise ValueError(f"profile coefficients has unknown keys: {unknown}")
        provenance = {
            key: value
            for key, value in data.items()
            if key not in ("name", "description", "coefficients", "max_total_token_num")
        }
        return cls(
            name=data["name"],
            description=data.get("description", ""),
            max_total_token_num=data["max_total_token_num"],
            provenance=provenance,
            **{key: coefficients[key] for key in COEFFICIENT_NAMES},
        )

    def save(self, path: str | Path) -> Path:
        """Write the profile as indented JSON and return the path."""
        out = Path(path)
        # allow_nan=False: a NaN in the provenance would make a file no JSON reader takes.
        out.write_text(json.dumps(self.to_dict(), indent=2, ensure_ascii=False, allow_nan=False) + "\n",
                       encoding="utf-8")
        return out


# The bundled profile every simulator command runs on when --profile is not given: the seed's hardware.
DEFAULT_PROFILE = "h100_qwen_0p8b"


def available_profiles() -> List[str]:
    """Names of the bundled profiles (``profiles/*.json``)."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def _profile_file(name_or_path: str) -> Path:
    """The file ``--profile`` names: a bundled profile's name first, else a path (any file name)."""
    if not name_or_path.strip():
        raise ValueError(f"profile {name_or_path!r} is empty; name a bundled profile "
                         f"({', '.join(available_profiles()) or 'none'}) or a profile file")
    bundled = PROFILE_DIR / f"{name_or_path}.json"
    if Path(name_or_path).name == name_or_path and bundled.is_file():
        return bundled
    candidate = Path(name_or_path)
    if candidate.is_dir():
        raise ValueError(f"profile {name_or_path!r} is a directory, not a profile file")
    if not candidate.is_file():
        raise ValueError(
            f"profile {name_or_path!r} is neither a file nor a bundled profile; "
            f"bundled: {', '.join(available_profiles()) or '(none)'}"
        )
    return candidate


def load_profile(name_or_path: str | Path) -> CostProfile:
    """Load a bundled profile by name, or any profile JSON file by path.

    Raises:
        ValueError: one line naming the profile and what is wrong with it (no such file, a file
            that cannot be read, is not UTF-8 JSON, or holds an invalid profile).
    """
    candidate = _profile_file(str(name_or_path))
    try:
        text = candidate.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"profile {str(candidate)!r} is not UTF-8 text (JSON): {exc.reason} "
                         f"at byte {exc.start}") from None
    except OSError as exc:
        raise ValueError(f"profile {str(candidate)!r} cannot be read: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"profile {str(candidate)!r} is not valid JSON: {exc}") from None
    try:
        return CostProfile.from_dict(data)
    except ValueError as exc:
        message = str(exc)
        # from_dict says "profile ..." of the JSON object; the file is named once, in front.
        message = message[len("profile "):] if message.startswith("profile ") else message
        raise ValueError(f"profile {str(candidate)!r}: {message}") from None
