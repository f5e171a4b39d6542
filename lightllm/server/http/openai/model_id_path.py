"""The ``/v1/models/{model_id}`` path type: a served name may hold '/', and an empty segment is no model.

Registered in Starlette's process-wide convertor table when a router needs it, not at import.
"""

from __future__ import annotations

from starlette.convertors import CONVERTOR_TYPES, Convertor, register_url_convertor

# The convertor's name in Starlette's table, which every app of the process shares: prefixed so it
# cannot take the place of (or be taken by) another library's "model_id".
MODEL_ID_CONVERTOR = "lightllm_model_id"


class _ModelIdConvertor(Convertor[str]):
    """A ``/v1/models/{model_id}`` segment: like Starlette's ``path`` (slashes allowed), but never empty."""

    regex = ".+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


def register_model_id_convertor() -> None:
    """Make :data:`MODEL_ID_CONVERTOR` usable in route paths (idempotent).

    Starlette's convertor table is process-wide, so this runs when a router needs it
    (:meth:`OpenAIEndpoints.router`), not when the module is imported: importing the HTTP layer
    (a tool, a test, the torch-free check) leaves Starlette as it was.
    """
    if not isinstance(CONVERTOR_TYPES.get(MODEL_ID_CONVERTOR), _ModelIdConvertor):
        register_url_convertor(MODEL_ID_CONVERTOR, _ModelIdConvertor())
