"""OpenAI request bodies: types checked field by field, unsupported features refused clearly."""

from __future__ import annotations

import pytest

from pdserve.errors import InvalidRequestError
from pdserve.router import openai_types as oa


def completion(body: bytes) -> oa.CompletionRequest:
    req: oa.CompletionRequest = oa.decode_body(body, oa.CompletionRequest)
    oa.check_completion(req)
    return req


def test_a_completion_body_becomes_sampling_params() -> None:
    req = completion(
        b'{"model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0, "top_k": -1, "stop": "\\n",'
        b' "seed": 3, "ignore_eos": true, "user": "someone", "unknown_field": 1}'
    )
    params = oa.sampling_params(req, 5)
    assert (params.max_tokens, params.temperature, params.top_k, params.stop, params.seed) == (
        5,
        0.0,
        0,
        ["\n"],
        3,
    )
    assert params.ignore_eos and oa.prompt_of(req) == "hi"
    assert params.min_tokens == 0 and params.logprobs is None


def test_min_tokens_and_logprobs_reach_the_sampling_params() -> None:
    req = completion(b'{"model": "m", "prompt": "hi", "min_tokens": 3, "logprobs": 2}')
    params = oa.sampling_params(req, 5)
    assert (params.min_tokens, params.logprobs) == (3, 2)
    chat = oa.decode_body(
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": true}',
        oa.ChatCompletionRequest,
    )
    assert oa.sampling_params(chat, 5).logprobs == 0  # the chosen token's only
    null = oa.decode_body(
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": null}',
        oa.ChatCompletionRequest,
    )
    assert oa.sampling_params(null, 5).logprobs is None  # null is "no", as OpenAI reads it
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        oa.sampling_params(completion(b'{"model": "m", "prompt": "hi", "min_tokens": 6}'), 5)


def test_prompts_as_token_ids_or_a_batch_of_one() -> None:
    assert oa.prompt_of(completion(b'{"model": "m", "prompt": [1, 2, 3]}')) == [1, 2, 3]
    assert oa.prompt_of(completion(b'{"model": "m", "prompt": ["only one"]}')) == "only one"
    with pytest.raises(InvalidRequestError, match="one prompt per request"):
        oa.prompt_of(completion(b'{"model": "m", "prompt": ["a", "b"]}'))
    with pytest.raises(InvalidRequestError, match="prompt must be"):
        oa.prompt_of(completion(b'{"model": "m", "prompt": [true, 2]}'))


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b'{"model": "m", "prompt": "x", "echo": true}', "echo is not supported"),
        (b'{"model": "m", "prompt": "x", "logprobs": 21}', "logprobs must be in [0, 20]"),
        (
            b'{"model": "m", "prompt": "x", "stream_options": {"include_usage": true}}',
            "only allowed when stream",
        ),
        (b'{"model": "m", "prompt": "x", "max_tokens": 1.5}', "got `float` - at `$.max_tokens`"),
        (b'{"model": "m", "prompt": "x", "stop": 3}', "$.stop"),
        (b'{"prompt": "x"}', "missing required field `model`"),
        (b"[1, 2]", "Expected `object`"),
    ],
)
def test_bad_completion_bodies_are_refused_with_the_reason(body: bytes, fragment: str) -> None:
    with pytest.raises(InvalidRequestError) as failure:
        completion(body)
    assert fragment in str(failure.value)


def test_chat_messages_with_text_parts_are_joined_and_other_parts_refused() -> None:
    req: oa.ChatCompletionRequest = oa.decode_body(
        b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},'
        b' {"type": "text", "text": "b"}]}], "max_completion_tokens": 7}',
        oa.ChatCompletionRequest,
    )
    assert oa.check_chat(req) == [{"role": "user", "content": "ab"}]
    assert oa.requested_max_tokens(req) == 7
    image: oa.ChatCompletionRequest = oa.decode_body(
        b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
        oa.ChatCompletionRequest,
    )
    with pytest.raises(InvalidRequestError, match="only text"):
        oa.check_chat(image)


def test_response_bodies_have_the_openai_shape() -> None:
    chat = oa.ResponseBuilder("chatcmpl-1", "m", chat=True)
    whole = chat.whole("Paris", "stop", None, oa.usage(3, 2))
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"]["content"] == "Paris"
    assert whole["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    first = chat.chunk("", role=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert oa.ResponseBuilder("cmpl-1", "m", chat=False).chunk("x")["choices"][0]["text"] == "x"
    assert oa.error_body("bad", "invalid_request_error", 400)["error"]["code"] == 400
