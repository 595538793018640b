"""API errors: one exception type, rendered as an OpenAI-shaped body
``{"error": {"message", "type", "param", "code"}}`` with its HTTP status. The runtime's typed
RequestError becomes one in server/common.py (api_error), keeping the field it carries."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.responses import Response

_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
    429: "rate_limit_error", 503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class JSONResponse(Response):
    """JSON via msgspec: fast, and NaN/inf (e.g. -inf logprobs of masked tokens) become null
    instead of invalid JSON."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return msgspec.json.encode(content)
