"""The fields the router reads are read as vLLM's OpenAI server reads them (pydantic, lax):
the body goes on unchanged, so a ``"stream": "true"`` that vLLM streams must be relayed as
a stream, and a field vLLM refuses is refused in vLLM's words."""

from __future__ import annotations

import pytest

from kvpool.openai_api import OpenAIError
from kvpool.router.proxy.request import read_fields


def test_scalars_are_read_as_vllm_reads_them() -> None:
    fields = read_fields(
        {
            "prompt": "hi",
            "stream": "true",
            "truncate_prompt_tokens": "100",
            "add_special_tokens": "false",
            "max_tokens": 7.0,
            "n": "2",
        },
        "completion",
    )
    assert fields.stream is True
    assert fields.truncate_prompt_tokens == 100
    assert fields.add_special_tokens is False
    assert fields.max_output == ("max_tokens", 7)
    assert fields.choices == 2
    chat = read_fields(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 9,
            "max_completion_tokens": "5",
        },
        "chat",
    )
    assert chat.max_output == ("max_completion_tokens", 5)  # vLLM's order


@pytest.mark.parametrize(
    ("body", "param", "entry"),
    [
        (
            {"prompt": "hi", "stream": "maybe"},
            "body.stream",
            "{'type': 'bool_parsing', 'loc': 'body.stream', 'msg': 'Input should be a valid "
            "boolean, unable to interpret input', 'input': 'maybe'}",
        ),
        (
            {"prompt": "hi", "truncate_prompt_tokens": "x"},
            "body.truncate_prompt_tokens",
            "{'type': 'int_parsing', 'loc': 'body.truncate_prompt_tokens', 'msg': 'Input should "
            "be a valid integer, unable to parse string as an integer', 'input': 'x'}",
        ),
        (
            {"prompt": "hi", "model": 5},
            "body.model",
            "{'type': 'string_type', 'loc': 'body.model', 'msg': 'Input should be a valid "
            "string', 'input': '5'}",
        ),
    ],
)
def test_a_field_of_the_wrong_type_is_refused_in_vllms_words(
    body: dict, param: str, entry: str
) -> None:
    with pytest.raises(OpenAIError) as err:
        read_fields(body, "completion")
    got = err.value.body()["error"]
    assert got == {
        "message": f"1 validation error:\n  {entry}",
        "type": "Bad Request",
        "param": param,
        "code": 400,
    }


def test_a_bad_output_limit_is_left_to_the_worker() -> None:
    """The router reads max_tokens only to refuse one over the context as vLLM does first;
    one it cannot read is not its to refuse."""
    fields = read_fields({"prompt": "hi", "max_tokens": "many"}, "completion")
    assert fields.max_output is None
