"""OpenAI-compatible request bodies (msgspec), their checks, and response bodies. No torch.

Decoding a body into these types checks every field's type and names the field that is wrong
("Expected `int`, got `str` - at `$.max_tokens`"); fields we do not know are ignored, as OpenAI
clients send many. What we know but do not support is refused with a clear 400 naming it rather
than silently ignored: the sampling fields of vLLM and OpenAI this server does not implement, and
the fields no client may decide here (a chat template or its arguments, KV-transfer parameters,
request ids): the server's own template renders every prompt, in Jinja's sandbox, and the server
names every request.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import msgspec

from pdserve.errors import InvalidRequestError
from pdserve.router.logprobs import engine_logprobs
from pdserve.sampling_params import SamplingParams

# Integers that travel to the workers as 64-bit msgpack ints: bounded here, so a huge one is a
# 400 naming the field rather than an encoding error later.
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024  # per stop string: each is matched against the text after every token
MAX_STOP_TOKEN_IDS = 1024
# The roles the chat templates of the models served here know; a template told another role may
# render it as something the model was never trained on.
CHAT_ROLES = ("system", "user", "assistant")


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Refused(msgspec.Struct, kw_only=True):
    """Fields a client may send that this server does not honour: any that is present is a 400."""

    chat_template: Any = msgspec.UNSET
    chat_template_kwargs: Any = msgspec.UNSET
    kv_transfer_params: Any = msgspec.UNSET
    request_id: Any = msgspec.UNSET
    guided_json: Any = msgspec.UNSET
    guided_regex: Any = msgspec.UNSET
    guided_choice: Any = msgspec.UNSET
    guided_grammar: Any = msgspec.UNSET
    structured_outputs: Any = msgspec.UNSET
    prompt_logprobs: Any = msgspec.UNSET
    use_beam_search: Any = msgspec.UNSET
    length_penalty: Any = msgspec.UNSET
    allowed_token_ids: Any = msgspec.UNSET
    bad_words: Any = msgspec.UNSET
    truncate_prompt_tokens: Any = msgspec.UNSET
    logits_processors: Any = msgspec.UNSET
    priority: Any = msgspec.UNSET
    mm_processor_kwargs: Any = msgspec.UNSET
    documents: Any = msgspec.UNSET
    continue_final_message: Any = msgspec.UNSET
    tool_choice: Any = msgspec.UNSET
    parallel_tool_calls: Any = msgspec.UNSET
    functions: Any = msgspec.UNSET
    function_call: Any = msgspec.UNSET
    audio: Any = msgspec.UNSET
    modalities: Any = msgspec.UNSET
    prediction: Any = msgspec.UNSET


REFUSED_FIELDS = _Refused.__struct_fields__
# Fields vLLM takes that steer things the server must decide for itself.
_SERVER_DECIDES = frozenset({"chat_template", "chat_template_kwargs", "kv_transfer_params", "request_id"})


class _SamplingFields(_Refused, kw_only=True):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Int64 = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_tokens: Int64 = 0
    user: str | None = None
    # OpenAI's shape: token ids as strings, biases in [-100, 100].
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[Any]
    max_tokens: Int64 | None = 16  # OpenAI's default for completions
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int64 | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool | None = False  # null allowed, as OpenAI's and vLLM's
    top_logprobs: Int64 | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True


def decode_body(body: bytes, kind: type[CompletionRequest] | type[ChatCompletionRequest]) -> Any:
    if not body.strip():
        raise InvalidRequestError("the request body is empty: send a JSON object")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"invalid request: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from exc


def check_common(req: _SamplingFields) -> None:
    for name in REFUSED_FIELDS:
        if getattr(req, name) is not msgspec.UNSET:
            why = (
                "is decided by the server, not the client" if name in _SERVER_DECIDES else "is not supported"
            )
            raise InvalidRequestError(f"{name} {why} on this server: leave it out", param=name)
    if req.n != 1:
        raise InvalidRequestError("only n=1 is supported", param="n")
    if req.stream_options is not None and not req.stream:
        raise InvalidRequestError(
            "stream_options is only allowed when stream is true", param="stream_options"
        )
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise InvalidRequestError(
            f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters", param="stop"
        )
    if len(req.stop_token_ids or []) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids", param="stop_token_ids")


def check_token_ids(req: _SamplingFields, vocab_size: int) -> None:
    """Token ids a request names must exist in the model's vocabulary."""
    outside = [t for t in req.stop_token_ids or [] if not 0 <= t < vocab_size]
    if outside:
        raise InvalidRequestError(
            f"stop_token_ids {outside[:4]} are outside the vocabulary [0, {vocab_size})",
            param="stop_token_ids",
        )
    bias = logit_bias_of(req)
    if any(not 0 <= t < vocab_size for t in bias):
        raise InvalidRequestError(
            f"logit_bias names token ids outside the vocabulary [0, {vocab_size})", param="logit_bias"
        )


def logit_bias_of(req: _SamplingFields) -> dict[int, float]:
    """logit_bias with integer keys; InvalidRequestError naming the field for a key that is not one."""
    bias: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit()) or len(key) > 12:  # "²".isdigit() is True
            raise InvalidRequestError(
                f"logit_bias keys must be token ids, got {key!r}"[:200], param="logit_bias"
            )
        token = int(key)
        if token in bias:  # "1" and "01": one of the two values would be dropped unsaid
            raise InvalidRequestError(f"logit_bias names token {token} twice ({key!r})", param="logit_bias")
        bias[token] = value
    return bias


def check_completion(req: CompletionRequest) -> None:
    check_common(req)
    logprobs_wanted(req)
    for name, unsupported in (
        ("echo", req.echo),
        ("suffix", req.suffix is not None),
        ("best_of", req.best_of not in (None, 1)),
    ):
        if unsupported:
            raise InvalidRequestError(f"{name} is not supported by this server")


def check_chat(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template wants them: role and text content."""
    check_common(req)
    logprobs_wanted(req)
    if req.tools:
        raise InvalidRequestError("tools are not supported by this server")
    if req.response_format not in (None, {"type": "text"}):
        raise InvalidRequestError("only response_format {'type': 'text'} is supported")
    if not req.messages:
        raise InvalidRequestError("messages must hold at least one message")
    messages = []
    for i, message in enumerate(req.messages):
        if message.role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role {message.role!r} is not one this server's chat template knows "
                f"({', '.join(CHAT_ROLES)})",
                param=f"messages[{i}].role",
            )
        content = message.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise InvalidRequestError(f"messages[{i}]: only text content parts are supported")
                parts.append(part.text)
            content = "".join(parts)
        messages.append({"role": message.role, "content": content or ""})
    return messages


def logprobs_wanted(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """The engine's `logprobs` for this request (alternatives per token; None: none at all)."""
    if isinstance(req, ChatCompletionRequest):
        return engine_logprobs(True, req.logprobs, req.top_logprobs)
    return engine_logprobs(False, req.logprobs, None)


def prompt_of(req: CompletionRequest) -> str | list[int]:
    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        return prompt
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if prompt and all(isinstance(p, str | list) for p in prompt):
        raise InvalidRequestError("only one prompt per request is supported")
    raise InvalidRequestError("prompt must be a string or a non-empty list of token ids")


def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k in (None, -1) else req.top_k,  # vLLM spells "off" as -1
        min_p=req.min_p or 0.0,
        seed=req.seed,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logit_bias=logit_bias_of(req),
        logprobs=logprobs_wanted(req),
    )


def requested_max_tokens(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens


# -- responses --------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape; the official client raises it as the matching APIError."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ResponseBuilder:
    """The JSON bodies of one request's answer (whole or in chunks)."""

    def __init__(self, request_id: str, model: str, chat: bool) -> None:
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())

    def _envelope(self, kind: Literal["whole", "chunk"]) -> dict[str, Any]:
        if self.chat:
            obj = "chat.completion" if kind == "whole" else "chat.completion.chunk"
        else:
            obj = "text_completion"
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def whole(
        self,
        text: str,
        finish_reason: str | None,
        stop_reason: int | str | None,
        use: dict[str, int],
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body = self._envelope("whole")
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        body["choices"] = [choice]
        body["usage"] = use
        return body

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
        *,
        role: bool = False,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body = self._envelope("chunk")
        choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        body["choices"] = [choice]
        return body

    def usage_chunk(self, use: dict[str, int]) -> dict[str, Any]:
        body = self._envelope("chunk")
        body["choices"] = []
        body["usage"] = use
        return body
