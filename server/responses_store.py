"""The in-memory store behind /v1/responses: `previous_response_id`, `GET` and `DELETE`.

Per server, bounded twice (a count and the bytes of the stored JSON), least recently used first out.
An entry is the response object and the conversation that led to it (input items of the whole
chain, the response's own output last), kept as encoded JSON: its size is what it costs, and
nothing a reader does can change what a later reader gets. A response larger than the whole byte
budget is not stored (a later lookup is a 404, as after eviction).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, NamedTuple

import msgspec

logger = logging.getLogger("radixlm.server.responses")

DEFAULT_MAX_RESPONSES = 1024
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


class Stored(NamedTuple):
    response: dict[str, Any]  # the Response object as GET returns it
    items: list[dict[str, Any]]  # the conversation: every input item of the chain, then this response's output


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_responses < 1 or max_bytes < 1:
            raise ValueError(f"a response store needs room: max_responses={max_responses}, max_bytes={max_bytes}")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], items: list[dict[str, Any]]) -> bool:
        """Stores a response under its id, evicting the least recently used past either bound;
        False (nothing stored) when it alone is larger than the byte budget."""
        data = msgspec.json.encode({"response": response, "items": items})
        if len(data) > self.max_bytes:
            logger.warning("response %s not stored: %d bytes, more than the store's %d", response["id"], len(data),
                           self.max_bytes)
            return False
        self.delete(response["id"])
        self._entries[response["id"]] = data
        self.bytes += len(data)
        while len(self._entries) > self.max_responses or self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= len(old)
        return True

    def get(self, response_id: str) -> Stored | None:
        """The stored response (now the most recently used), None if unknown or evicted."""
        data = self._entries.get(response_id)
        if data is None:
            return None
        self._entries.move_to_end(response_id)
        entry = msgspec.json.decode(data)
        return Stored(entry["response"], entry["items"])

    def delete(self, response_id: str) -> bool:
        data = self._entries.pop(response_id, None)
        if data is None:
            return False
        self.bytes -= len(data)
        return True
