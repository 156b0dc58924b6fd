"""API keys from `WORKER_GATEWAY_KEYS_FILE`: each key gives its requests a tenant and a
priority. The file is read again when it changes (a Kubernetes Secret update swaps the
mounted file), keys are compared in constant time and never logged."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trtllm_worker.contract.errors import ConfigError
from trtllm_worker.contract.job import describe
from trtllm_worker.contract.priority import MAX_PRIORITY

log = logging.getLogger(__name__)

CHECK_EVERY_S = 1.0
"""How often a lookup looks at the file's identity (one `stat`) for a change."""


class _Grant(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant: Annotated[str, Field(min_length=1, max_length=128)]
    priority: Annotated[int, Field(ge=0, le=MAX_PRIORITY)]


@dataclass(frozen=True, slots=True)
class Caller:
    """Whom a request is for: its jobs carry `tenant` (None: no keys) and `priority`."""

    tenant: str | None
    priority: int


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def read_keys(path: Path) -> dict[bytes, tuple[bytes, Caller]]:
    """The file's keys by their SHA-256; `ConfigError` naming the file (never a key)."""
    try:
        data = json.loads(path.read_bytes())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the keys file: {exc.strerror}") from None
    except ValueError as exc:
        raise ConfigError(f"{path}: not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must be a JSON object, API key → tenant and priority")
    keys: dict[bytes, tuple[bytes, Caller]] = {}
    for number, (key, value) in enumerate(data.items(), 1):
        if not key.strip() or key != key.strip():
            raise ConfigError(f"{path}: key {number} is empty or has surrounding spaces")
        try:
            grant = _Grant.model_validate(value)
        except ValidationError as exc:
            raise ConfigError(f"{path}: key {number} (tenant …): {describe(exc)}") from None
        digest = _digest(key)
        keys[digest] = (digest, Caller(grant.tenant, grant.priority))
    return keys


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


class KeyRing:
    """The keys in force. Without a file the gateway is open: every request gets
    `open_caller`. A file that turns bad keeps the keys last read (and says so)."""

    def __init__(self, path: Path | None, open_caller: Caller) -> None:
        self.path = path
        self.open_caller = open_caller
        self._keys: dict[bytes, tuple[bytes, Caller]] = {}
        self._identity: tuple[int, int, int] | None = None
        self._checked = time.monotonic()
        self.reloads = 0
        if path is not None:
            self._identity = _identity(path)
            self._keys = read_keys(path)

    @property
    def is_open(self) -> bool:
        return self.path is None

    def __len__(self) -> int:
        return len(self._keys)

    def lookup(self, key: str | None) -> Caller | None:
        """The caller of a bearer key; None if the key is missing or not listed."""
        if self.path is None:
            return self.open_caller
        self._maybe_reload(self.path)
        if not key:
            return None
        # looked up by the key's SHA-256, so how long the lookup takes depends on no part
        # of the key an attacker could grow byte by byte; the one comparison that decides
        # is made in constant time
        digest = _digest(key)
        found = self._keys.get(digest)
        if found is None:
            return None
        stored, caller = found
        return caller if hmac.compare_digest(stored, digest) else None

    def _maybe_reload(self, path: Path) -> None:
        now = time.monotonic()
        if now - self._checked < CHECK_EVERY_S:
            return
        self._checked = now
        identity = _identity(path)
        if identity == self._identity:
            return
        try:
            keys = read_keys(path)
        except ConfigError as exc:
            log.error("keys file changed but cannot be used, keeping the keys in force: %s", exc)
            self._identity = identity  # said once per change, not per request
            return
        self._keys, self._identity = keys, identity
        self.reloads += 1
        log.info("keys file %s read again: %d keys", path, len(keys))

    def force_check(self) -> None:
        """Look at the file on the next lookup, whenever the last look was."""
        self._checked = float("-inf")
