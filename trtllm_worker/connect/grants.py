"""Least privilege: the Redis ACL rules and RabbitMQ permissions each role needs for the
current settings (queue name, stream prefix), and nothing more. `trtllm-worker acl`
prints them; the tests run every role under exactly these grants.

Roles: `trtllm-worker` (the worker), `trtllm-subscriber` (reads streams), `trtllm-admin`
(the CLI's cancel, dead-letter, requeue and batch commands) in Redis; `trtllm-worker`,
`trtllm-producer` (publishes jobs and cancels) and `trtllm-admin` in RabbitMQ;
`trtllm-gateway` (`trtllm-worker gateway`: answers, streams, cancels, Files and Batches)
in both."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

from trtllm_worker.config import Settings
from trtllm_worker.contract.errors import ConfigError
from trtllm_worker.contract.queues import CANCEL_QUEUE_ID_HEX

PASSWORD = "PASSWORD"
"""The placeholder an operator replaces (`>PASSWORD` in the rules)."""

WORKER, SUBSCRIBER, ADMIN, PRODUCER, GATEWAY = (
    "trtllm-worker",
    "trtllm-subscriber",
    "trtllm-admin",
    "trtllm-producer",
    "trtllm-gateway",
)

CONNECTION_COMMANDS = (
    "+ping",
    "+client|setname",  # the connection's name, as operators see it in CLIENT LIST
    # (not CLIENT SETINFO, unknown before Redis 7.2: the worker's clients never send it)
    "+info",  # which Redis it is: one node or a cluster
    "+cluster|slots",  # Redis Cluster: the slot map (redis-py's cluster client)
    "+command",  # redis-py's cluster client learns where each command keeps its keys
)
"""Every role's client: connecting, naming the connection, finding the topology."""

WORKER_COMMANDS = (
    # the write, start, end and lease scripts (EVALSHA, loaded on NOSCRIPT)
    "+evalsha",
    "+script|load",
    "+script|exists",
    # what those scripts call: ACL applies to a script's own calls
    "+xadd",
    "+xlen",
    "+xrange",
    "+xrevrange",
    "+xtrim",
    "+exists",
    "+get",
    "+set",
    "+del",
    "+expire",
    "+pexpire",
    "+hincrby",  # per-tenant usage, counted with a terminal entry
    # outside scripts: reading a stream to resume it, counting deliveries (classic
    # queues), storing a cancel mark, waiting for replicas (WORKER_REDIS_MIN_REPLICAS)
    "+incrby",  # redis-py's INCR
    "+wait",
)

SUBSCRIBER_COMMANDS = ("+xread", "+xrange", "+xrevrange", "+xlen")

BATCH_COMMANDS = (
    # batches (client/batches.py), for `trtllm-worker batch` and the gateway's Batches
    # API alike: the batch's hash (submit, status, finalize), its refused lines (HLEN),
    # its per-slot counters (HMGET), the index `batch list` reads and prunes, each line's
    # pending marker (SET NX) and record (GET), the publishing lease (SET NX, SET, DEL);
    # every key's expiry
    "+set",
    "+del",
    "+hgetall",
    "+hset",
    "+hsetnx",
    "+hlen",
    "+hmget",
    "+zadd",
    "+zrevrange",
    "+zrem",
    "+get",
    "+expire",
    # a batch's cancel and its expiry (any status read may find it due) end the lines no
    # worker took with the worker's fenced write script (EVALSHA, loaded on NOSCRIPT);
    # what that script calls there beyond the commands above
    "+evalsha",
    "+script|load",
    "+xadd",
    "+xlen",
    "+exists",
    "+hincrby",
)

ADMIN_COMMANDS = tuple(  # each command once: the subscriber's XLEN is a batch one too
    dict.fromkeys(
        (
            *SUBSCRIBER_COMMANDS,
            # cancel: the cancel mark (SET); requeue: the reset script; usage: the
            # day's counter keys (SCAN, HGETALL); housekeeping of keys (TYPE, DEL)
            "+eval",
            "+type",
            "+scan",
            *BATCH_COMMANDS,
        )
    )
)

GATEWAY_COMMANDS = (
    # an answer and `/v1/streams`: reading the job's stream, and whether it ended at or
    # before a reconnecting client's Last-Event-ID (its last entry); a client gone
    # before its answer ended: the cancel mark (the SDK's cancel, SET)
    "+xread",
    "+xrevrange",
    # Files (gateway/files.py): an upload's hash and its chunks (a list), read back,
    # deleted, kept WORKER_BATCH_TTL_S (HSET, HGETALL, DEL, EXPIRE: below)
    "+rpush",
    "+llen",
    "+lrange",
    *BATCH_COMMANDS,
)


def _glob(text: str) -> str:
    """`text` literally in a Redis glob pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _regex(text: str) -> str:
    return re.escape(text)


def _keys(prefix: str, *, read_only: bool = False) -> tuple[str, ...]:
    """The streams (`<prefix><id>`) and their hash-tagged side keys (`{<prefix><id>}:…`,
    lease, cancel mark, delivery counter)."""
    mark = "%R~" if read_only else "~"
    streams = f"{mark}{_glob(prefix)}*"
    if read_only:
        return (streams,)
    return (streams, f"~{{{_glob(prefix)}*}}:*")


REQUEST_ID_FIRST = "[A-Za-z0-9]"
"""A request id's first character (contract/job.py) as a glob: a stream key is the prefix
and a request id, never `_` (the batches' and the usage counters' keys) nor `{`."""


def _gateway_keys(prefix: str) -> tuple[str, ...]:
    """The gateway's keys, narrower than `_keys`: streams, the files' and batches' keys,
    and of the side keys the cancel mark, the batch line and the lease; never the usage
    counters or a delivery count. The write script only asks whether a worker holds the
    lease (its fence), but a script's declared keys need read and write access (ACL):
    the lease cannot be read-only."""
    p = _glob(prefix)
    return (
        f"~{p}{REQUEST_ID_FIRST}*",  # streams: read; a batch line's end (cancel, expiry)
        f"~{p}_file:*",  # uploaded files: P_file:F, P_file:F:data
        f"~{p}_batch:*",  # P_batch:B and its :invalid, :counts…, :submitter
        f"~{p}_batches",  # the index of batches
        f"~{p}_gateway:*",  # each gateway process's wake stream (gateway/reader.py)
        f"~{{{p}*}}:cancel",
        f"~{{{p}*}}:batch",
        f"~{{{p}*}}:lease",
    )


@dataclass(frozen=True)
class Permissions:
    """A RabbitMQ user's permissions on the vhost: regular expressions of resource
    names (queues and exchanges) it may configure, write to and read from."""

    configure: str
    write: str
    read: str


def _either(*names: str) -> str:
    return "^(" + "|".join(names) + ")$"


NOTHING = "^$"
OWN_QUEUE = rf"\.[0-9a-f]{{{CANCEL_QUEUE_ID_HEX}}}"
"""After the cancel exchange's name: a worker's exclusive cancel queue (only its own
connection can use it)."""
DEFAULT_EXCHANGE = r"amq\.default"


def redis_rules(settings: Settings) -> dict[str, list[str]]:
    """Each Redis user's ACL rules, `ACL SETUSER <user> <rules…>`, in order."""
    prefix = settings.stream_prefix
    if any(c.isspace() for c in prefix):
        raise ConfigError("WORKER_STREAM_PREFIX holds a space: an ACL key pattern cannot")
    base = ["reset", "on", f">{PASSWORD}", "resetchannels"]
    return {
        WORKER: [*base, *_keys(prefix), *CONNECTION_COMMANDS, *WORKER_COMMANDS],
        SUBSCRIBER: [*base, *_keys(prefix, read_only=True), *CONNECTION_COMMANDS,
                     *SUBSCRIBER_COMMANDS],
        ADMIN: [*base, *_keys(prefix), *CONNECTION_COMMANDS, *ADMIN_COMMANDS],
        GATEWAY: [*base, *_gateway_keys(prefix), *CONNECTION_COMMANDS, *GATEWAY_COMMANDS],
    }  # fmt: skip


def rabbitmq_permissions(settings: Settings) -> dict[str, Permissions]:
    """Each RabbitMQ user's permissions on the worker's vhost."""
    queue = _regex(settings.queue)
    dead, cancel = _regex(settings.dead_queue), _regex(settings.cancel_exchange)
    own = cancel + OWN_QUEUE
    return {
        WORKER: Permissions(
            # declares the job queue, the dead-letter queue, the cancel exchange and its
            # own cancel queue
            configure=_either(queue, dead, cancel, own),
            # publishes dead letters (the default exchange), binds its cancel queue
            write=_either(DEFAULT_EXCHANGE, own),
            # consumes jobs and cancels; binding reads the cancel exchange
            read=_either(queue, cancel, own),
        ),
        PRODUCER: Permissions(
            configure=NOTHING,
            write=_either(DEFAULT_EXCHANGE, cancel),  # jobs, cancels
            read=NOTHING,
        ),
        ADMIN: Permissions(
            configure=NOTHING,
            # requeues dead letters to the job queue, cancels
            write=_either(DEFAULT_EXCHANGE, cancel),
            read=_either(dead),  # lists and takes dead letters
        ),
        GATEWAY: Permissions(
            # the queue's depth (WORKER_GATEWAY_MAX_QUEUED) is a passive queue.declare,
            # which RabbitMQ checks against no permission; the cancel exchange is
            # published to, never declared (the workers declare it)
            configure=NOTHING,
            write=_either(DEFAULT_EXCHANGE, cancel),  # jobs and batch lines, cancels
            read=NOTHING,
        ),
    }


def vhost_of(settings: Settings) -> str:
    """The vhost of the first AMQP URL (`/` when the URL gives none)."""
    from urllib.parse import unquote, urlsplit

    path = urlsplit(settings.amqp_urls[0]).path
    return unquote(path[1:]) if len(path) > 1 else "/"


def as_json(settings: Settings) -> str:
    grants = {
        "redis": redis_rules(settings),
        "rabbitmq": {user: asdict(p) for user, p in rabbitmq_permissions(settings).items()},
    }
    return json.dumps(grants, indent=2)


def as_text(settings: Settings) -> str:
    """Ready to paste: `ACL SETUSER …` lines for redis-cli (or an ACL file, without the
    `ACL SETUSER`) and `rabbitmqctl` lines; PASSWORD is each user's password."""
    vhost = vhost_of(settings)
    lines = [
        f"# Redis (keys under {settings.stream_prefix!r}); on Redis Cluster, on every node,"
        " or in each node's ACL file",
    ]
    for user, rules in redis_rules(settings).items():
        lines.append(f"ACL SETUSER {user} {' '.join(rules)}")
    lines.append("")
    lines.append(f"# RabbitMQ (vhost {vhost!r}, queue {settings.queue!r})")
    for user, p in rabbitmq_permissions(settings).items():
        lines.append(f"rabbitmqctl add_user {user} {PASSWORD}")
        lines.append(
            f"rabbitmqctl set_permissions -p {_shell(vhost)} {user}"
            f" {_shell(p.configure)} {_shell(p.write)} {_shell(p.read)}"
        )
    return "\n".join(lines) + "\n"


def _shell(word: str) -> str:
    return "'" + word.replace("'", "'\\''") + "'"


def redis_user(url: str) -> str:
    from urllib.parse import unquote, urlsplit

    username = urlsplit(url.split(",")[0]).username
    return unquote(username) if username else "default"


def redis_refusal(settings: Settings, refused: list[str], role: str = WORKER) -> str:
    """One line naming what the Redis user of `role` (the worker's, the gateway's) may
    not do."""
    return (
        f"Redis user {redis_user(settings.redis_url)!r} may not run {', '.join(refused)}"
        f" on keys under {settings.stream_prefix!r} (ACL): grant what"
        f" `trtllm-worker acl` prints for {role}"
    )


def rabbitmq_refusal(reason: str) -> str:
    """One line from the broker's ACCESS_REFUSED reply."""
    return f"RabbitMQ refused: {reason}: grant what `trtllm-worker acl` prints for trtllm-worker"
