"""The router's OpenAPI 3.1 document (`GET /openapi.json`), made from the same msgspec types that
decode the bodies, so the document and the server cannot disagree on a field. No torch.

Fields the server refuses (pdserve.router.openai_types._Refused) are left out of it: a client
reading the document sees only what works, with the bounds the server enforces on the fields
with list or map values (stop strings, stop token ids, logit_bias) and on logprobs; the ranges
of the numeric sampling fields (temperature, top_p, penalties, ...) are checked by the server
and named in its 400s, not written here. Responses list every status the route may answer (400,
401, 408, 413, 429, 503, ...), each with OpenAI's error body; a route that takes a key on this
server (pdserve.router.auth) says so with a `security` requirement.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pdserve.router import openai_types as oa
from pdserve.router.admin import DrainBody, ScaleBody
from pdserve.router.auth import AccessKeys, route_kind
from pdserve.router.logprobs import MAX_TOP_LOGPROBS
from pdserve.sampling_params import MAX_LOGIT_BIAS

_REF = "#/components/schemas/{name}"
_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["integer", "string", "null"]},
            },
        }
    },
}
_STATUS_TEXT = {
    "400": "A bad request: the message (and `param`) says what is wrong",
    "401": "A missing or wrong key (when the server has keys)",
    "404": "No such pool or worker, or this router manages no pools",
    "408": "The body did not arrive in time",
    "413": "The body is over the server's limit",
    "429": "Too many requests in flight, or an SLO the request would miss (see Retry-After)",
    "500": "The request failed on the workers (its retries used up, or its worker lost mid-stream)",
    "503": "No worker can take it now",
}


def _errors(*codes: str) -> dict[str, Any]:
    return {
        code: {
            "description": _STATUS_TEXT[code],
            "content": {"application/json": {"schema": {"$ref": _REF.format(name="Error")}}},
        }
        for code in codes
    }


def _json_body(name: str, required: bool = True, example: dict[str, Any] | None = None) -> dict[str, Any]:
    media: dict[str, Any] = {"schema": {"$ref": _REF.format(name=name)}}
    if example is not None:
        media["example"] = example
    return {"required": required, "content": {"application/json": media}}


def _ok(description: str, media: str = "application/json") -> dict[str, Any]:
    return {"200": {"description": description, "content": {media: {"schema": {}}}}}


def _any_value(kind: type) -> dict[str, Any]:
    """ScaleBody.replicas is typed `object` (the pool manager checks it, to name the bounds)."""
    if kind is object:
        return {"description": "any JSON value (the server names what it accepts)"}
    raise NotImplementedError(kind)


def _bounded(schema: dict[str, Any], chat: bool) -> None:
    """The limits the server checks, where a client reading the document can see them."""
    props = schema["properties"]
    stop_string = {"type": "string", "minLength": 1, "maxLength": oa.MAX_STOP_CHARS}
    props["stop"] = {
        "anyOf": [
            stop_string,
            {"type": "array", "items": stop_string, "maxItems": oa.MAX_STOP_STRINGS},
            {"type": "null"},
        ],
        "default": None,
    }
    token_id = {"type": "integer", "minimum": 0, "description": "below the vocabulary size"}
    props["stop_token_ids"] = {
        "anyOf": [{"type": "array", "items": token_id, "maxItems": oa.MAX_STOP_TOKEN_IDS}, {"type": "null"}],
        "default": None,
    }
    bias = props["logit_bias"]["anyOf"][0]
    bias["maxProperties"] = MAX_LOGIT_BIAS
    bias["propertyNames"] = {
        "pattern": "^[0-9]{1,12}$",
        "description": "a token id below the vocabulary size",
    }
    bias["additionalProperties"] = {"type": "number", "minimum": -100, "maximum": 100}
    top = {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}
    props["top_logprobs" if chat else "logprobs"] = {"anyOf": [top, {"type": "null"}], "default": None}
    if chat:
        props["top_logprobs"]["description"] = "needs logprobs: true"


def build_openapi(model_name: str, keys: AccessKeys | None = None) -> dict[str, Any]:
    """The document; `keys`: which kinds of route take a key on this server (none: all open)."""
    (_, components) = msgspec.json.schema_components(
        [oa.CompletionRequest, oa.ChatCompletionRequest, ScaleBody, DrainBody],
        schema_hook=_any_value,
        ref_template=_REF,
    )
    for schema in components.values():  # what is refused is not offered
        for name in oa.REFUSED_FIELDS:
            schema.get("properties", {}).pop(name, None)
    for body in ("CompletionRequest", "ChatCompletionRequest"):  # the one model served here
        components[body]["properties"]["model"] = {"type": "string", "enum": [model_name]}
        _bounded(components[body], chat=body.startswith("Chat"))
    components["ChatMessage"]["properties"]["role"] = {"type": "string", "enum": list(oa.CHAT_ROLES)}
    components["Error"] = _ERROR
    generation = ("400", "401", "408", "413", "429", "500", "503")
    pool_param = {"name": "pool", "in": "path", "required": True, "schema": {"type": "string"}}
    worker_param = {"name": "worker", "in": "path", "required": True, "schema": {"type": "string"}}
    paths: dict[str, Any] = {
        "/v1/completions": {
            "post": {
                "summary": "A completion (streamed as server-sent events with stream: true)",
                "requestBody": _json_body(
                    "CompletionRequest",
                    example={"model": model_name, "prompt": "Once upon a time", "max_tokens": 8},
                ),
                "responses": {**_ok("The completion, or its events"), **_errors(*generation)},
            }
        },
        "/v1/chat/completions": {
            "post": {
                "summary": "A chat completion (streamed as server-sent events with stream: true)",
                "requestBody": _json_body(
                    "ChatCompletionRequest",
                    example={
                        "model": model_name,
                        "messages": [{"role": "user", "content": "Hi!"}],
                        "max_tokens": 8,
                    },
                ),
                "responses": {**_ok("The chat completion, or its events"), **_errors(*generation)},
            }
        },
        "/v1/models": {
            "get": {"summary": "The model served", "responses": {**_ok("The model list"), **_errors("401")}}
        },
        "/health": {
            "get": {
                "summary": "Whether a request can be served now, and each worker's state (no key needed)",
                "responses": {**_ok("Serving"), "503": {"description": "Not serving now"}},
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "responses": {**_ok("Metrics", "text/plain"), **_errors("401")},
            }
        },
        "/pools": {
            "get": {
                "summary": "Each pool's target, bounds, workers and planner (admin key)",
                "responses": {**_ok("The pools"), **_errors("401", "404")},
            }
        },
        "/pools/{pool}": {
            "put": {
                "summary": "Scale a pool within its bounds (admin key)",
                "parameters": [pool_param],
                "requestBody": _json_body("ScaleBody"),
                "responses": {**_ok("The pool's new target"), **_errors("400", "401", "404", "408", "413")},
            }
        },
        "/pools/{pool}/rebalance": {
            "post": {
                "summary": "Move streams from a pool's busiest workers to its idlest (admin key)",
                "parameters": [pool_param],
                "responses": {**_ok("The streams moved"), **_errors("400", "401", "404")},
            }
        },
        "/workers/{worker}/drain": {
            "post": {
                "summary": "Drain a worker (its streams move, nothing is lost), then stop it (admin key)",
                "parameters": [worker_param],
                "requestBody": _json_body("DrainBody", required=False),
                "responses": {**_ok("The worker's state"), **_errors("400", "401", "404", "408", "413")},
            }
        },
    }
    for path, operations in paths.items():
        if _needs_key(route_kind(path), keys or AccessKeys()):
            for operation in operations.values():
                operation["security"] = [{"bearer": []}]
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "pdserve",
            "version": "1",
            "description": f"OpenAI-compatible API of a pdserve router serving {model_name!r}",
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def _needs_key(kind: str, keys: AccessKeys) -> bool:
    """As pdserve.router.auth decides: with API keys and no admin key the admin API is closed,
    which a client sees as needing a key it does not have."""
    if kind == "open":
        return False
    if kind == "admin":
        return bool(keys.admin or keys.api)
    return bool(keys.metrics if kind == "metrics" else keys.api)
