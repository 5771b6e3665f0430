"""The API's documented patterns say what the validators they document accept."""

from __future__ import annotations

import re

from hypothesis import example, given
from hypothesis import strategies as st
from pydantic import TypeAdapter
from pydantic import ValidationError as PydanticValidationError

from consolidation.api.models import TAG_PATTERN, Tag
from consolidation.scopes import MAX_TAG_CHARS, tag_problem

# Control characters, DEL, Unicode spaces and ordinary letters, so every rule gets exercised.
tag_text = st.text(
    alphabet=st.sampled_from(["a", "é", ",", " ", "\t", "\x00", "\x1f", "\x7f", "\x85", "\u3000"]),
    max_size=MAX_TAG_CHARS + 2,
) | st.text(max_size=8)


@given(tag_text)
@example("a\x7fb")
@example("t" * (MAX_TAG_CHARS + 1))
def test_the_tag_pattern_in_the_openapi_document_agrees_with_the_tag_rule(tag: str) -> None:
    documented = re.fullmatch(TAG_PATTERN, tag) is not None and 1 <= len(tag) <= MAX_TAG_CHARS
    assert documented == (tag_problem(tag) is None)


@given(tag_text)
@example("a\x7fb")
def test_the_api_tag_type_is_the_tag_rule(tag: str) -> None:
    try:
        TypeAdapter(Tag).validate_python(tag)
        accepted = True
    except PydanticValidationError:
        accepted = False
    assert accepted == (tag_problem(tag) is None)
