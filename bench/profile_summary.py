"""Summarise a py-spy raw profile (`BENCH_PROFILE=1 make bench`): the functions taking
the most samples, inclusive and self. `python bench/profile_summary.py FILE [N]`."""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path


def frame_name(frame: str) -> str:
    where = re.search(r"\((.*?)\)", frame)
    file = where.group(1).split("/")[-1].split(":")[0] if where else ""
    function = frame.split(" (", 1)[0]
    return f"{function} ({file})"


def summarise(path: Path, top: int = 20) -> str:
    total, inclusive, own = 0, Counter[str](), Counter[str]()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        samples = int(count)
        frames = [frame_name(f) for f in stack.split(";")]
        total += samples
        own[frames[-1]] += samples
        for name in set(frames):
            inclusive[name] += samples
    lines = [f"{path.name}: {total} samples", "", "inclusive:"]
    lines += [f"  {n / total:6.1%}  {name}" for name, n in inclusive.most_common(top)]
    lines += ["", "self:"]
    lines += [f"  {n / total:6.1%}  {name}" for name, n in own.most_common(top)]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarise(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 20))
