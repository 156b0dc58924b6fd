"""The TensorRT-LLM releases the adapters are written and tested for, in one place: the
adapters check the installed release at start, the GPU image checks it at build time, and
the docs' table follows it. Imports nothing of TensorRT-LLM (the image's build check runs
it before anything loads a GPU library)."""

from __future__ import annotations

import importlib.metadata
import logging
import re
from typing import Final

from trtllm_worker.contract.errors import ConfigError

log = logging.getLogger(__name__)

STABLE: Final = "1.2.1"
"""The newest stable release: the GPU image's default base (`TRTLLM_VERSION`)."""
OLDEST: Final = (1, 2)
NEWEST: Final = (1, 4)
REQUIREMENT: Final = "tensorrt-llm>=1.2,<1.5"
"""What the adapters support: 1.2.x (stable), the 1.3 release candidates and 1.4."""
EXECUTOR_LAST: Final = (1, 2)
"""The last line with the C++ `Executor` binding (PR #16369 removed it: absent from
1.3.0rc22 on), so the last that `WORKER_ENGINE=trtllm-executor` can run on."""

_RELEASE = re.compile(r"^(\d+)\.(\d+)")


def release(version: str) -> tuple[int, int]:
    """The (major, minor) line of a version string such as "1.4.0rc1" or "1.2.1.post1"."""
    found = _RELEASE.match(version.strip())
    if found is None:
        raise ValueError(f"not a TensorRT-LLM version: {version!r}")
    return int(found.group(1)), int(found.group(2))


def check(version: str) -> None:
    """At start: a release older than the oldest supported line is one line and no start
    (its LLM API lacks what the adapters call); a newer line than the newest tested one is
    a warning, since the adapters read signatures rather than versions and may well work."""
    try:
        line = release(version)
    except ValueError:
        log.warning("TensorRT-LLM reports an unreadable version %r: not checked", version)
        return
    if line < OLDEST:
        raise ConfigError(
            f"TensorRT-LLM {version} is too old: the worker supports {REQUIREMENT} "
            f"(newest stable {STABLE}); use a newer release container"
        )
    if line > NEWEST:
        log.warning(
            "TensorRT-LLM %s is newer than the lines the worker is tested on (%s): "
            "check the release notes for LLM API changes",
            version,
            REQUIREMENT,
        )


def installed() -> str:
    """The installed distribution's version, read without importing `tensorrt_llm`."""
    return importlib.metadata.version("tensorrt_llm")


def main() -> None:
    """`python -m trtllm_worker.engine.versions`: the GPU image's build check, exit 1 with
    the reason when the base image's TensorRT-LLM is one the worker does not support."""
    version = installed()
    try:
        check(version)
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    print(f"tensorrt_llm {version}: supported ({REQUIREMENT})")


if __name__ == "__main__":
    main()
