"""The 400 a client gets for a body its pydantic model refuses: the field as the client wrote it.

pydantic names the union alternatives it tried inside its error locations (``content.str``) and
reports an error for each; the client's field path has no such parts.
"""

from __future__ import annotations

from typing import Any, List, Optional, Union

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from lightllm.server.http.validation.validation_errors import describe_validation_error


class Part(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str
    text: str


class Options(BaseModel):
    include_usage: bool = False


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    content: Union[str, List[Part]] = ""
    options: Optional[Options] = None
    count: int = 0


def _describe(data: dict[str, Any]) -> tuple[str, Optional[str]]:
    with pytest.raises(ValidationError) as caught:
        Body.model_validate(data)
    return describe_validation_error(caught.value.errors(include_url=False), data)


def test_a_union_field_of_the_wrong_type_is_named_without_the_alternatives():
    message, param = _describe({"content": 5})
    assert param == "content"
    assert message == "Invalid value for 'content': Input should be a string or a list"


def test_the_alternative_the_client_meant_is_the_one_reported():
    message, param = _describe({"content": [{"type": "text", "text": 1}]})
    assert param == "content.0.text"
    assert "valid string" in message


def test_a_field_missing_inside_a_union_alternative_is_named():
    message, param = _describe({"content": [{"type": "text"}]})
    assert param == "content.0.text"
    assert message == "Missing required parameter 'content.0.text'"


def test_an_object_of_the_wrong_type_names_no_python_class():
    message, param = _describe({"options": 5})
    assert param == "options"
    assert "Options" not in message and message.endswith("Input should be an object")


def test_unknown_and_plain_fields_keep_their_sentences():
    assert _describe({"colour": 1}) == ("Unknown parameter 'colour'; it is not accepted by this endpoint", "colour")
    message, param = _describe({"count": "x"})
    assert param == "count" and "valid integer" in message


def test_without_the_body_every_location_part_is_kept():
    error = {"type": "string_type", "loc": ("a", 0, "b"), "msg": "Input should be a valid string"}
    assert describe_validation_error([error]) == ("Invalid value for 'a.0.b': Input should be a valid string", "a.0.b")


def test_a_body_key_named_like_an_alternative_does_not_hijack_the_path():
    # {"str": "x"} is neither a string nor a list of parts; its key only shares the str alternative's name.
    message, param = _describe({"content": {"str": "x"}})
    assert param == "content"
    assert message == "Invalid value for 'content': Input should be a string or a list"
