"""Which Redis errors are a request's fault and which the server's: the pump writes a
batch stream by stream only after a refusal that would come again (`refused_for_good`),
and the ACL probe names the commands a user may not run (`acl_refused`)."""

from __future__ import annotations

from redis.exceptions import (
    ClusterDownError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)

_SERVER_STATE = ("BUSY", "LOADING", "MASTERDOWN", "MISCONF", "NOREPLICAS", "NOSCRIPT")
"""Error codes that say what state the server is in (a script running long, a dataset
loading, a failing disk, too few replicas), whatever the request."""


def refused_for_good(exc: BaseException) -> bool:
    """A Redis error that the same call would meet again, whatever the server's state: a
    script error on one request's keys (a key of the wrong type, an expiry Redis cannot
    set). Not: connection errors, a read-only replica, out of memory, cluster states, an
    ACL refusal (the configuration: every stream meets it) or the codes of
    `_SERVER_STATE`."""
    if not isinstance(exc, ResponseError) or isinstance(
        exc,
        NoScriptError
        | ReadOnlyError
        | OutOfMemoryError
        | NoPermissionError
        | ClusterDownError
        | TryAgainError,
    ):
        return False
    return not str(exc).startswith(_SERVER_STATE) and not acl_refused(exc)


def acl_refused(exc: ResponseError) -> bool:
    """An ACL refusal: NOPERM (redis-py strips the code into the type), or a script's
    call refused ("can't run this command")."""
    return isinstance(exc, NoPermissionError) or "can't run this command" in str(exc)
