"""The offline API, shaped like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from pdserve.config import EngineConfig
from pdserve.engine.factory import build_engine
from pdserve.errors import InvalidRequestError
from pdserve.outputs import CompletionOutput, RequestOutput, TokenLogprob
from pdserve.sampling_params import SamplingParams
from pdserve.text.detok import IncrementalDetokenizer

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """Loads a model once and generates for batches of prompts, all scheduled together."""

    def __init__(self, model: str, dtype: str = "auto", **engine_options: Any) -> None:
        self.config = EngineConfig(model=model, dtype=dtype, **engine_options)
        self.engine, self.tokenizer = build_engine(self.config)
        self._ids = itertools.count()
        # Detokenize with the Rust tokenizer underneath transformers' where it gives the same text
        # (no clean-up of spaces): transformers' own decode converts every id list in Python first,
        # a few microseconds a call, twice a token, which a GPU's decode step cannot afford.
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        cleans_up = getattr(self.tokenizer, "clean_up_tokenization_spaces", True)
        self._decoder = backend if backend is not None and not cleans_up else self.tokenizer

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in order. A prompt is a string or a list of token ids.

        Every prompt is checked before any is queued: one bad prompt fails the call, cleanly."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        encoded = [self._encode(p) for p in prompt_list]
        for ids, params in zip(encoded, params_list, strict=True):
            self.engine.validate(ids, params)
        return self._run([p if isinstance(p, str) else None for p in prompt_list], encoded, params_list)

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation or a list of conversations."""
        if not isinstance(messages, Sequence) or not messages:
            raise InvalidRequestError("messages must be a non-empty list of {'role', 'content'} dicts")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        texts: list[Prompt] = []
        for conversation in conversations:
            _check_conversation(conversation)
            texts.append(
                self.tokenizer.apply_chat_template(
                    conversation, tokenize=False, add_generation_prompt=add_generation_prompt
                )
            )
        params_list = _as_params_list(sampling_params, len(texts))
        # The template already holds any BOS token the model wants: add no special tokens again.
        encoded = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        for ids, params in zip(encoded, params_list, strict=True):
            self.engine.validate(ids, params)
        return self._run([str(t) for t in texts], encoded, params_list)

    # -- internals ----------------------------------------------------------------------------------
    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty: give at least one character")
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    def _run(
        self, texts: list[str | None], encoded: list[list[int]], params_list: list[SamplingParams]
    ) -> list[RequestOutput]:
        engine = self.engine
        states: dict[str, _Pending] = {}
        order: list[str] = []
        for text, ids, params in zip(texts, encoded, params_list, strict=True):
            request_id = f"offline-{next(self._ids)}"
            engine.add_request(request_id, ids, params)
            detok = IncrementalDetokenizer(
                self._decoder,
                ids,
                params.stop,
                params.include_stop_str_in_output,
                params.skip_special_tokens,
                params.min_tokens,
            )
            states[request_id] = _Pending(text, ids, params, detok)
            order.append(request_id)
        try:
            while any(not s.done for s in states.values()):
                outputs = engine.step()
                if not outputs and not engine.has_unfinished:
                    raise RuntimeError("the engine stopped with requests unfinished")
                for out in outputs:
                    state = states[out.request_id]
                    for i, token in enumerate(out.new_token_ids):
                        state.token_ids.append(token)
                        if out.new_logprobs is not None:
                            state.logprobs.append(out.new_logprobs[i])
                        if token in engine.eos_token_ids and not state.params.ignore_eos:
                            continue  # EOS ends the text; it is in token_ids, not in text
                        if state.detok.add_token(token) is not None:
                            engine.finish(out.request_id, state.detok.stop_reason)
                            state.finish("stop", state.detok.stop_reason, out.num_preemptions)
                            break
                    if out.finished and not state.done:
                        state.finish(out.finish_reason, out.stop_reason, out.num_preemptions)
        finally:
            for request_id, state in states.items():
                if not state.done:
                    engine.abort(request_id)
        return [states[rid].result(rid) for rid in order]


class _Pending:
    def __init__(
        self, text: str | None, prompt_ids: list[int], params: SamplingParams, detok: IncrementalDetokenizer
    ) -> None:
        self.text = text
        self.prompt_ids = prompt_ids
        self.params = params
        self.detok = detok
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.done = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0

    def finish(self, reason: str | None, stop_reason: int | str | None, num_preemptions: int) -> None:
        self.done = True
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.num_preemptions = num_preemptions

    def result(self, request_id: str) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=self.detok.text,
            token_ids=self.token_ids,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=self.logprobs if self.params.logprobs is not None else None,
        )
        return RequestOutput(
            request_id, self.text, self.prompt_ids, [completion], self.done, self.num_preemptions
        )


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence) or not prompts:
        raise InvalidRequestError(
            "prompts must be a string, a list of token ids, or a non-empty list of those"
        )
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [list(prompts)]  # type: ignore[arg-type]
    result: list[Prompt] = []
    for p in prompts:
        if isinstance(p, str) or (
            isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
        ):
            result.append(p)
        else:
            raise InvalidRequestError(f"a prompt must be a string or a list of token ids, got {p!r:.80}")
    return result


def _as_params_list(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    params = list(sampling_params)
    if len(params) != count:
        raise InvalidRequestError(f"got {len(params)} sampling params for {count} prompts")
    return params


def _check_conversation(conversation: Any) -> None:
    if not isinstance(conversation, list) or not conversation:
        raise InvalidRequestError("a conversation must be a non-empty list of messages")
    for message in conversation:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise InvalidRequestError(f"each message needs 'role' and 'content', got {message!r:.80}")
