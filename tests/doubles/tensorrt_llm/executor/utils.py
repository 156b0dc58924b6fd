# mirrors tensorrt_llm/executor/utils.py (1.2.x): the two names the LLM API double needs.
from __future__ import annotations

import asyncio


def has_event_loop() -> bool:
    """True when an asyncio loop is running in the calling thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class RequestError(RuntimeError):
    """The error raised when the request is failed."""
