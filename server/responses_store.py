"""The in-memory store behind /v1/responses: `previous_response_id`, `GET` and `DELETE`.

Per server, bounded twice (a count and the bytes of the stored JSON), least recently used first out.
An entry is the response object and the conversation that led to it (input items of the whole
chain, the response's own output last), kept as encoded JSON: its size is what it costs, and
nothing a reader does can change what a later reader gets. A response larger than the whole byte
budget is not stored (put says so, and the response says `"store": false`).

A conversation is a tuple of encoded chunks, one a turn: a turn that continues a stored one shares
its chunks (no copy) and adds its own, so a chain of turns costs each turn's new items once, and a
reader decodes a conversation only when it asks for it (`Conversation.decode`), within a size the
route checks first. Each entry counts every chunk it holds (shared ones too) against the budget.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec

logger = logging.getLogger("radixlm.server.responses")

DEFAULT_MAX_RESPONSES = 1024
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Conversation:
    """Items of a conversation as encoded JSON arrays, one a turn, shared by the turns that continue it."""

    chunks: tuple[bytes, ...] = ()

    @property
    def size(self) -> int:
        return sum(len(c) for c in self.chunks)

    def extend(self, items: list[dict[str, Any]]) -> Conversation:
        return Conversation((*self.chunks, msgspec.json.encode(items))) if items else self

    def decode(self) -> list[dict[str, Any]]:
        return [item for chunk in self.chunks for item in msgspec.json.decode(chunk)]


class Stored(NamedTuple):
    response: bytes  # the Response object as GET returns it, encoded
    conversation: Conversation  # every input item of the chain, then this response's output


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_responses < 1 or max_bytes < 1:
            raise ValueError(f"a response store needs room: max_responses={max_responses}, max_bytes={max_bytes}")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._pending: set[str] = set()  # responses being generated, to be stored when they finish
        self._deleted: set[str] = set()  # ... of which a DELETE said: do not

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _size(entry: Stored) -> int:
        return len(entry.response) + entry.conversation.size

    def fits(self, conversation: Conversation) -> bool:
        """Whether an entry holding `conversation` can be stored at all (before its response exists)."""
        return conversation.size < self.max_bytes

    def begin(self, response_id: str) -> None:
        """A response to be stored is being generated: a DELETE before it finishes deletes it."""
        self._pending.add(response_id)

    def end(self, response_id: str) -> None:
        """Its generation is over (stored, failed or cut off)."""
        self._pending.discard(response_id)
        self._deleted.discard(response_id)

    def put(self, response: dict[str, Any], conversation: Conversation) -> bool:
        """Stores a response under its id, evicting the least recently used past either bound;
        False (nothing stored) when it alone is larger than the byte budget, or was deleted while
        it was generated."""
        if response["id"] in self._deleted:
            return False
        entry = Stored(msgspec.json.encode(response), conversation)
        if self._size(entry) > self.max_bytes:
            logger.warning("response %s not stored: %d bytes, more than the store's %d", response["id"],
                           self._size(entry), self.max_bytes)
            return False
        self.delete(response["id"])
        self._entries[response["id"]] = entry
        self.bytes += self._size(entry)
        while len(self._entries) > self.max_responses or self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= self._size(old)
        return True

    def get(self, response_id: str) -> Stored | None:
        """The stored entry (now the most recently used), None if unknown or evicted. Nothing is
        decoded here: the caller decodes what it needs, off the event loop."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        """Deletes a stored response, or one being generated (then it is never stored)."""
        if response_id in self._pending:
            self._pending.discard(response_id)
            self._deleted.add(response_id)
            return True
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= self._size(entry)
        return True
