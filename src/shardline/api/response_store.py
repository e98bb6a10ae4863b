"""The Responses API's stored responses, for ``previous_response_id`` and
``GET``/``DELETE /v1/responses/{id}``: held in this node's memory, bounded in count and in
size, the least recently used dropped first.

OpenAI keeps stored responses for 30 days; a node keeps at most :data:`MAX_ENTRIES` of
them and :data:`MAX_BYTES` of their text, and forgets them when it restarts. The node that
stores a response gives it to every live peer before the client has it whole
(:mod:`shardline.api.responses`), and a deletion too, so that any node serves it, also
after the node that answered it died; a node that joins later, or was down, has only the
responses stored since.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

MAX_ENTRIES = 1000
MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class StoredResponse:
    """One stored response.

    Attributes:
        response: the response object as answered (OpenAI's ``Response``).
        items: the conversation's input items up to this response, in Responses input
            item format (those of the responses it continues first; ``instructions`` are
            not among them, as OpenAI does not carry them over).
        size: its size in bytes, as the store counts it (e.g. its JSON text's length).
    """

    response: dict
    items: tuple[dict, ...]
    size: int

    @classmethod
    def of(cls, response: dict, items: list[dict] | tuple[dict, ...]) -> "StoredResponse":
        """The entry of ``response`` and its input ``items``, its size their JSON text's."""
        return cls(response, tuple(items), len(json.dumps([response, list(items)], ensure_ascii=False)))

    def conversation(self) -> list[dict]:
        """The items a response continuing this one starts from: its input items, then
        its output items."""
        return list(self.items) + list(self.response.get("output", []))


class ResponseStore:
    """Stored responses by id, at most ``max_entries`` of them and ``max_bytes`` of their
    sizes together; putting one drops the least recently put or read until both hold.

    Raises:
        ValueError: from the constructor, for a bound below 1.
    """

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError(f"bounds must be at least 1: max_entries {max_entries}, max_bytes {max_bytes}")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._entries

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Store ``entry`` under ``response_id`` (replacing one stored under it), dropping
        the least recently used entries while a bound is exceeded. Returns False, storing
        nothing, for an entry larger than ``max_bytes`` alone."""
        self.delete(response_id)
        if entry.size > self.max_bytes:
            return False
        self._entries[response_id] = entry
        self.bytes += entry.size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= dropped.size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry stored under ``response_id`` (now the most recently used), or None."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        """Forget ``response_id``; whether it was stored."""
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True
