"""Per-request leases: a worker writes a stream only while it holds the request's lease
in Redis, so a worker that lost a job (its broker connection died and another took the
job over) is fenced out. This module holds the tokens of the jobs in hand, takes leases
(waiting out another holder), renews them, and reports the ones lost."""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable

from trtllm_worker.connect.redis import REDIS_FAILURES
from trtllm_worker.contract.errors import HandBack
from trtllm_worker.streams.store import StreamState, StreamStore

log = logging.getLogger(__name__)

OnLost = Callable[[str], None]
"""Called with the stream key of a lease found lost (expired, maybe taken by another)."""


class Leases:
    """The lease tokens of the requests this worker has in hand, by stream key."""

    def __init__(self, store: StreamStore, *, ttl_s: float) -> None:
        self._store = store
        self._ttl_s = ttl_s
        self._ids = itertools.count(1)
        self._token_prefix = uuid.uuid4().hex[:12]
        """Lease tokens are this process's 48 random bits and a counter: unique per
        attempt, and short, since every write carries its token."""
        self._tokens: dict[str, str] = {}

    def __contains__(self, key: str) -> bool:
        return key in self._tokens

    def __len__(self) -> int:
        return len(self._tokens)

    def token(self, key: str) -> str:
        """This worker's token for `key`, '' when it holds none."""
        return self._tokens.get(key, "")

    def snapshot(self) -> dict[str, str]:
        return dict(self._tokens)

    def new_token(self) -> str:
        return f"{self._token_prefix}:{next(self._ids):x}"

    async def take(
        self,
        key: str,
        token: str,
        start: Callable[[], Awaitable[StreamState | None]],
        stopping: Callable[[], bool],
    ) -> StreamState:
        """Own the request before touching its stream, and read what it holds (`start`:
        the store's one-round-trip call, retried by the caller's policy). A lease held
        by another worker (one that lost its broker connection, or a duplicate message
        running there) is waited out: it expires when its owner is gone, or is released
        when it ends."""
        poll_s = min(self._ttl_s / 4, 1.0)
        while (stream := await start()) is None:
            if stopping():
                raise HandBack("the worker is stopping")
            await asyncio.sleep(poll_s)
        self._tokens[key] = token
        return stream

    def forget(self, key: str, token: str | None = None) -> str | None:
        """Stop tracking `key` (its lease was released with the terminal entry, or will
        be released by the caller). With `token`, only if it is still that one."""
        if token is not None and self._tokens.get(key) != token:
            return None
        return self._tokens.pop(key, None)

    def forget_all(self, keys: Iterable[str]) -> dict[str, str]:
        """Stop tracking these keys; returns their tokens, for `release`."""
        return {key: token for key in keys if (token := self._tokens.pop(key, None))}

    async def release(self, leases: dict[str, str]) -> None:
        """Release leases this worker no longer needs, so the next owner need not wait
        for them to expire (they do expire on their own when this fails)."""
        try:
            await self._store.release_leases(leases)
        except REDIS_FAILURES as exc:
            log.debug("releasing %d leases failed: %s", len(leases), exc)

    async def keep(self, on_lost: OnLost) -> None:
        """Forever: renew the leases of the jobs in hand; report each one lost."""
        every_s = self._ttl_s / 3
        while True:
            await asyncio.sleep(every_s)
            await self.renew(on_lost)

    async def renew(self, on_lost: OnLost) -> None:
        """Renew every lease in one round trip; a lease that is no longer ours is
        forgotten and reported (its job is handed back by `on_lost`)."""
        leases = self.snapshot()
        try:
            lost = await self._store.renew_leases(leases)
        except REDIS_FAILURES as exc:
            log.warning("renewing %d leases failed: %s", len(leases), exc)
            return
        for key in lost:
            if self.forget(key, leases[key]) is not None:  # else it ended meanwhile
                on_lost(key)


def lease_lost(request_id: str) -> HandBack:
    return HandBack("the lease was lost", request_id=request_id)
