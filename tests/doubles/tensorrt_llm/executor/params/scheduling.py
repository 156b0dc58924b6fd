# mirrors tensorrt_llm/executor/params/scheduling.py (1.4 era, @ 1f064c46): what the
# reference (§9) gives as its fields; the worker does not pass it.
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulingParams:
    attention_dp_rank: int | None = None
    attention_dp_relax: bool | None = None
