"""Server-sent events framing, exactly as OpenAI clients and `vllm bench serve` parse it.

Each event is one `data: <json>` line and a blank line: no `event:` or `id:`
fields, a space after the colon, ASCII-only JSON. The stream ends with
`data: [DONE]`.
"""

from __future__ import annotations

from .protocol import dumps

CONTENT_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"


def event(obj: object) -> bytes:
    """One SSE event carrying obj as JSON."""
    return b"data: " + dumps(obj).encode("ascii") + b"\n\n"
