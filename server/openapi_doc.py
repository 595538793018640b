"""/openapi.json with the real request bodies.

Routes read their bodies themselves (strict JSON limits, field names spelled per API), so FastAPI
cannot see them; this module declares each body's model and puts it into the generated document
(`requestBody` with a `$ref` into components), so schema-driven clients and fuzzers send real
requests. The native models below document SGLang's fields; the routes validate them by hand.
"""

from __future__ import annotations

import html
import re
import warnings
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict

from radixlm.runtime.request.params import SamplingParams
from radixlm.server.openai_models import ChatCompletionRequest, ChatMessage, CompletionRequest
from radixlm.server.responses_convert import ResponsesRequest


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GenerateRequest(_Doc):
    """SGLang's GenerateReqInput: the fields RadixLM serves (its other names are accepted too)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int] | list[list[int]] | None = None  # these ids' logprobs at every position
    return_text_in_logprobs: bool = False
    stream: bool = False


class TokenizeRequest(_Doc):
    """Exactly one of prompt or messages."""

    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    model: str | None = None


class DetokenizeRequest(_Doc):
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True
    model: str | None = None


class ApplyChatTemplateRequest(_Doc):
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    model: str | None = None


class AbortRequest(_Doc):
    """SGLang's {"rid": ...} or {"abort_all": true}."""

    rid: str | None = None
    abort_all: bool = False
    finished_reason: Any = None
    abort_message: str | None = None


BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/generate": GenerateRequest,
    "/tokenize": TokenizeRequest,
    "/v1/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/detokenize": DetokenizeRequest,
    "/apply_chat_template": ApplyChatTemplateRequest,
    "/abort_request": AbortRequest,
    "/v1/responses": ResponsesRequest,
}


def install_openapi(app: FastAPI) -> None:
    """Replaces app.openapi with a generator that adds the bodies above (built once, cached)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # FastAPI's documented way to customise the document


def build_openapi(app: FastAPI) -> dict[str, Any]:
    with warnings.catch_warnings():  # a route serving two methods (POST|PUT /generate) shares one id: renamed below
        warnings.filterwarnings("ignore", "Duplicate Operation ID")
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            op["operationId"] = f"{method}_{re.sub(r'[^A-Za-z0-9]+', '_', path).strip('_')}"
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, model in BODIES.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
        body = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        for method in ("post", "put"):
            if method in doc["paths"].get(path, {}):
                doc["paths"][path][method]["requestBody"] = body
    return doc


def docs_page(doc: dict[str, Any]) -> str:
    """/docs: the routes of an OpenAPI document as one self-contained page (no script, nothing
    fetched from elsewhere; Swagger UI would load its code from a CDN)."""
    rows = []
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            ref = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
            body = ref.get("$ref", "").rsplit("/", 1)[-1]
            cells = (method.upper(), path, op.get("summary", ""), body)
            rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    title = html.escape(f"{doc['info']['title']} {doc['info']['version']}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title} API</title><style>"
            "body{font:14px sans-serif;margin:2em}td,th{padding:2px 12px;text-align:left}"
            "tr:nth-child(even){background:#f3f3f3}</style></head><body>"
            f"<h1>{title}</h1><p>The request bodies' schemas, field by field: "
            "<a href='/openapi.json'>/openapi.json</a>.</p>"
            "<table><tr><th>Method</th><th>Path</th><th>Summary</th><th>Body</th></tr>"
            + "".join(rows) + "</table></body></html>")
