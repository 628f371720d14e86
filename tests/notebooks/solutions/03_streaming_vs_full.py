"""Reference solution of notebook 03's exercise: the answer text of a chat stream."""

from __future__ import annotations

import json


def sse_text(lines: list[str]) -> str:
    text = []
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue  # the blank line between events; the end marker
        event = json.loads(line[len("data: ") :])
        if "error" in event:  # the stream failed after it began
            raise RuntimeError(event["error"]["message"])
        for choice in event["choices"]:  # none in the usage chunk
            text.append(choice["delta"].get("content") or "")
    return "".join(text)
