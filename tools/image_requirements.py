"""Which of the lock's requirements an image must still install.

`uv export` writes every locked package as a hash-pinned requirement. On NVIDIA's
TensorRT-LLM image, the packages the image already holds (torch, pydantic, llguidance, ...)
are TensorRT-LLM's own and must not change, so they are left out here; pip then installs
the rest with the image's versions as constraints, and a lock pin that disagrees with the
image fails the build instead of breaking TensorRT-LLM.

    python3 image_requirements.py EXPORTED.txt INSTALLED.txt > TO_INSTALL.txt

INSTALLED.txt is `pip list --format=freeze`. Standard library only: it runs in the image.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Iterator


def normalize(name: str) -> str:
    """PEP 503: names compare case-insensitively, with runs of -_. as one dash."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_blocks(lines: Iterable[str]) -> Iterator[list[str]]:
    """Each requirement with its continuation lines (hashes); comments and blanks dropped."""
    block: list[str] = []
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        block.append(line.rstrip("\n"))
        if not line.rstrip().endswith("\\"):
            yield block
            block = []
    if block:
        yield block


def block_name(block: list[str]) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", block[0])
    if match is None:
        raise ValueError(f"not a requirement: {block[0]!r}")
    return normalize(match.group(1))


def installed_names(freeze: Iterable[str]) -> set[str]:
    """Names from `pip list --format=freeze` (`name==version` lines)."""
    return {normalize(line.split("==")[0]) for line in freeze if "==" in line}


def missing(exported: Iterable[str], installed: set[str]) -> list[str]:
    """The exported requirement lines of packages the image does not hold."""
    kept: list[str] = []
    for block in requirement_blocks(exported):
        if block_name(block) not in installed:
            kept.extend(block)
    return kept


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1]) as exported, open(argv[2]) as freeze:
        for line in missing(exported, installed_names(freeze)):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
