"""Least privilege, under real grants: a private redis-server with ACL users and a
private RabbitMQ vhost with users, both made from what `trtllm-worker acl --json`
prints for this test's queue and prefix. The worker's whole path runs under them, and
each role is refused what it must not do."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import aiormq
import pytest
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError

from tests.integration.conftest import (
    Producer,
    Spawn,
    Subscriber,
    WorkerProcess,
    terminal,
    tokens,
)
from tests.integration.test_faults import assert_exact, wait_for_entries
from tests.services import ServiceUrls
from trtllm_worker.connect.redis import QUIET_HANDSHAKE

ROLES_REDIS = ("trtllm-worker", "trtllm-subscriber", "trtllm-admin")
ROLES_RABBITMQ = ("trtllm-worker", "trtllm-producer", "trtllm-admin")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def rid() -> str:
    return f"acl-{uuid.uuid4().hex[:10]}"


def acl_json(names: dict[str, str], **env: str) -> dict[str, Any]:
    """What `trtllm-worker acl --json` prints for this test's queue and prefix."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    environment.update(WORKER_QUEUE=names["queue"], WORKER_STREAM_PREFIX=names["stream_prefix"])
    environment.update(env)
    result = subprocess.run(
        [sys.executable, "-m", "trtllm_worker", "acl", "--json"],
        env=environment,
        capture_output=True,
        text=True,
        check=True,
    )
    grants: dict[str, Any] = json.loads(result.stdout)
    return grants


def rabbitmqctl(*args: str) -> str:
    result = subprocess.run(
        ["rabbitmqctl", *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@dataclass
class Granted:
    """The private Redis and vhost; each role's URLs."""

    redis_port: int
    vhost: str
    suffix: str
    grants: dict[str, Any]
    passwords: dict[str, str] = field(default_factory=dict)

    def rabbitmq_user(self, role: str) -> str:
        return f"{role}-{self.suffix}"  # RabbitMQ users are global to the broker

    def redis_url(self, role: str) -> str:
        return f"redis://{role}:{self.passwords[role]}@127.0.0.1:{self.redis_port}/0"

    def amqp_url(self, role: str) -> str:
        user = self.rabbitmq_user(role)
        return f"amqp://{user}:{self.passwords[role]}@127.0.0.1:5672/{self.vhost}"

    def set_redis_user(self, role: str, rules: list[str]) -> None:
        password = self.passwords[role]
        rules = [f">{password}" if rule == ">PASSWORD" else rule for rule in rules]
        result = subprocess.run(
            ["redis-cli", "-p", str(self.redis_port), "ACL", "SETUSER", role, *rules],
            capture_output=True,
            text=True,
            check=True,
        )
        assert result.stdout.strip() == "OK", result.stdout

    def set_permissions(self, role: str, configure: str, write: str, read: str) -> None:
        user = self.rabbitmq_user(role)
        rabbitmqctl("set_permissions", "-p", self.vhost, user, configure, write, read)


@pytest.fixture
def granted(names: dict[str, str], services: ServiceUrls, tmp_path: Path) -> Iterator[Granted]:
    """Users made from the `--json` output, on a private redis-server (stopped after)
    and a private vhost of the broker (deleted after, with its users). The default
    Redis user and the broker's guest (on the vhost) stay the test's own admin."""
    if services.source != "running services":
        pytest.skip("the grants test provisions the local broker with rabbitmqctl")
    grants = acl_json(names)
    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    suffix = uuid.uuid4().hex[:8]
    vhost = f"test-acl-{suffix}"
    state = Granted(port, vhost, suffix, grants)
    made: list[str] = []
    try:
        _wait_listening(port)
        for role in {*ROLES_REDIS, *ROLES_RABBITMQ}:
            state.passwords[role] = secrets.token_hex(12)
        for role, rules in grants["redis"].items():
            state.set_redis_user(role, rules)
        rabbitmqctl("add_vhost", vhost)
        rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        for role, permissions in grants["rabbitmq"].items():
            user = state.rabbitmq_user(role)
            rabbitmqctl("add_user", user, state.passwords[role])
            made.append(user)
            state.set_permissions(
                role, permissions["configure"], permissions["write"], permissions["read"]
            )
        yield state
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
        subprocess.run(["rabbitmqctl", "delete_vhost", vhost], capture_output=True, check=False)
        for user in made:
            subprocess.run(["rabbitmqctl", "delete_user", user], capture_output=True, check=False)


def _wait_listening(port: int) -> None:
    """Until the private redis-server accepts connections (another process: polled)."""
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        assert time.monotonic() < deadline, "the private redis-server did not start"
        time.sleep(0.05)


@pytest.fixture
async def as_roles(
    granted: Granted, names: dict[str, str]
) -> AsyncIterator[tuple[Producer, Subscriber, Producer]]:
    """A producer (trtllm-producer), a subscriber (trtllm-subscriber) and an operator
    reading dead letters (trtllm-admin), each with only its own grants."""
    producing = await aio_pika.connect(granted.amqp_url("trtllm-producer"))
    admin = await aio_pika.connect(granted.amqp_url("trtllm-admin"))
    # a subscriber's redis-py told not to send CLIENT SETINFO (README "Security")
    reader = aioredis.Redis.from_url(
        granted.redis_url("trtllm-subscriber"), decode_responses=True, **QUIET_HANDSHAKE
    )
    try:
        yield (
            Producer(await producing.channel(), names["queue"]),
            Subscriber(reader, names["stream_prefix"]),
            Producer(await admin.channel(), names["queue"]),
        )
    finally:
        await producing.close()
        await admin.close()
        await reader.aclose()


def worker_urls(granted: Granted) -> dict[str, str]:
    return {
        "WORKER_AMQP_URL": granted.amqp_url("trtllm-worker"),
        "WORKER_REDIS_URL": granted.redis_url("trtllm-worker"),
    }


async def test_the_worker_runs_its_whole_path_under_its_grants(
    granted: Granted, as_roles: tuple[Producer, Subscriber, Producer], spawn: Spawn
) -> None:
    """Stream, cancel, dead letter and a resume after kill -9, each party as its role."""
    producer, subscriber, admin = as_roles
    first = await spawn(WORKER_ECHO_STEP_MS="10", **worker_urls(granted))

    done_id = rid()
    await producer.publish({"request_id": done_id, "inputs": "grants ", "parameters": {
        "max_new_tokens": 12}})  # fmt: skip
    assert_exact(await subscriber.read_until_terminal(done_id), "grants ", 12)

    cancel_id = rid()
    await producer.publish({"request_id": cancel_id, "inputs": "x", "parameters": {
        "max_new_tokens": 2000}})  # fmt: skip
    await wait_for_entries(subscriber, cancel_id, 5)
    await producer.cancel(cancel_id)
    assert terminal(await subscriber.read_until_terminal(cancel_id))["finish_reason"] == (
        "cancelled"
    )

    dead_id = rid()
    await producer.publish({"request_id": dead_id, "inputs": "x", "parameters": {
        "max_new_tokens": 10**6}})  # fmt: skip
    dead = await admin.get_dead()
    assert dead.headers["x-error-code"] == "invalid_request"
    assert terminal(await subscriber.read_until_terminal(dead_id))["event"] == "error"

    resumed_id, prompt, n = rid(), "Resume under grants ", 300
    await producer.publish({"request_id": resumed_id, "inputs": prompt, "parameters": {
        "max_new_tokens": n}})  # fmt: skip
    await wait_for_entries(subscriber, resumed_id, 40)
    first.signal(signal.SIGKILL)
    assert await first.wait() == -signal.SIGKILL
    partial = tokens(await subscriber.entries(resumed_id))
    assert 40 <= len(partial) < n
    second = await spawn(WORKER_ECHO_STEP_MS="1", **worker_urls(granted))
    assert_exact(await subscriber.read_until_terminal(resumed_id, wait_s=60), prompt, n)
    for worker in (first, second):
        assert "NOPERM" not in worker.log()
        assert "ACCESS_REFUSED" not in worker.log()
    # nothing the worker or the subscriber did was refused, even where it was retried
    root = aioredis.Redis(port=granted.redis_port, decode_responses=True)
    try:
        stats = await root.info("errorstats")
    finally:
        await root.aclose()
    assert "errorstat_NOPERM" not in stats, stats


async def test_each_role_is_refused_what_it_must_not_do(
    granted: Granted, names: dict[str, str], spawn: Spawn
) -> None:
    await spawn(**worker_urls(granted))  # the worker declares its queues
    prefix = names["stream_prefix"]
    root = aioredis.Redis(port=granted.redis_port, decode_responses=True)
    await root.set("other-app:secret", "s3cret")
    await root.xadd(prefix + "r1", {"event": "token"})
    as_worker = aioredis.Redis.from_url(
        granted.redis_url("trtllm-worker"), decode_responses=True, **QUIET_HANDSHAKE
    )
    as_subscriber = aioredis.Redis.from_url(
        granted.redis_url("trtllm-subscriber"), decode_responses=True, **QUIET_HANDSHAKE
    )
    try:
        for refused in (
            as_worker.get("other-app:secret"),
            as_worker.xrange("other-app:stream"),
            as_worker.flushall(),
            as_worker.flushdb(),
            as_worker.keys("*"),
            as_worker.config_get("*"),
            as_worker.script_flush(),
            as_worker.eval("return 1", 0),
            as_worker.publish("channel", "x"),
            as_worker.acl_list(),
            as_subscriber.xadd(prefix + "r1", {"event": "token"}),
            as_subscriber.delete(prefix + "r1"),
            as_subscriber.get("{" + prefix + "r1}:lease"),
            as_subscriber.get("other-app:secret"),
        ):
            with pytest.raises(NoPermissionError):
                await refused
        readable = await as_subscriber.xrange(prefix + "r1")  # what it may do
        assert readable is not None
        assert len(readable) == 1
        assert await as_worker.get(prefix + "r1-lease") is None
    finally:
        for client in (root, as_worker, as_subscriber):
            await client.aclose()

    connection = await aio_pika.connect(granted.amqp_url("trtllm-producer"))
    try:
        for attempt in (consume_jobs, declare_another_queue, take_dead_letters):
            channel = await connection.channel()
            with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
                await attempt(channel, names["queue"])
    finally:
        await connection.close()


async def consume_jobs(channel: aio_pika.abc.AbstractChannel, queue: str) -> None:
    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        raise AssertionError("a producer took a job")

    jobs = await channel.get_queue(queue, ensure=False)
    await jobs.consume(on_message)


async def declare_another_queue(channel: aio_pika.abc.AbstractChannel, queue: str) -> None:
    await channel.declare_queue(f"{queue}-another", durable=True)


async def take_dead_letters(channel: aio_pika.abc.AbstractChannel, queue: str) -> None:
    dead = await channel.get_queue(f"{queue}.dead", ensure=False)
    await dead.get(fail=False)


def test_the_rules_are_minimal(names: dict[str, str]) -> None:
    """Named commands only, keys only under the prefix and its side keys, no channels;
    RabbitMQ patterns anchored and limited to the worker's own names."""
    grants = acl_json(names)
    prefix, queue = names["stream_prefix"], names["queue"]
    assert set(grants["redis"]) == set(ROLES_REDIS)
    assert set(grants["rabbitmq"]) == set(ROLES_RABBITMQ)
    forbidden = ("flush", "keys", "config", "script|flush", "acl", "debug", "shutdown")
    for user, rules in grants["redis"].items():
        assert rules[:4] == ["reset", "on", ">PASSWORD", "resetchannels"], user
        for rule in rules[4:]:
            assert not rule.startswith(("+@", "allkeys", "allcommands", "allchannels", "&")), rule
            assert rule not in ("~*", "%R~*", "%W~*", "+@all"), rule
            if rule.startswith(("~", "%R~")):
                pattern = rule.split("~", 1)[1]
                assert pattern in (f"{prefix}*", f"{{{prefix}*}}:*"), rule
            else:
                assert rule.startswith("+"), rule
                assert not any(word in rule for word in forbidden), rule
    assert grants["redis"]["trtllm-subscriber"][4] == f"%R~{prefix}*"  # read only
    assert "+xadd" not in grants["redis"]["trtllm-subscriber"]
    allowed = {
        queue,
        f"{queue}.dead",
        f"{queue}.cancel",
        "amq.default",
        f"{queue}.cancel.0123456789ab",
    }
    others = {
        "another-queue",
        f"{queue}x",
        f"{queue}.deadx",
        f"x{queue}",
        "amq.direct",
        "amq.gen-1",
        f"{queue}.cancel.x",
        "",
    }
    for user, permissions in grants["rabbitmq"].items():
        for kind, pattern in permissions.items():
            assert pattern.startswith("^"), (user, kind)
            assert pattern.endswith("$"), (user, kind)
            matched = {name for name in allowed | others if re.search(pattern, name)}
            assert matched <= allowed | {""}, (user, kind, matched)
    producer = grants["rabbitmq"]["trtllm-producer"]
    assert producer["configure"] == producer["read"] == "^$"


async def test_a_missing_grant_is_one_line_in_check_and_the_worker_exits_69(
    granted: Granted, names: dict[str, str], spawn: Spawn, tmp_path: Path
) -> None:
    rules = list(granted.grants["redis"]["trtllm-worker"])
    # one command the scripts call, one the worker calls itself
    fewer = [r for r in rules[1:] if r not in ("+xadd", "+incrby")]
    granted.set_redis_user("trtllm-worker", ["reset", *fewer])
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env.update(
        WORKER_QUEUE=names["queue"], WORKER_STREAM_PREFIX=names["stream_prefix"],
        **worker_urls(granted),
    )  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trtllm_worker", "check", env=env, cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 60)
    stdout = out.decode()
    line = (
        f"problem Redis: Redis user 'trtllm-worker' may not run XADD, INCRBY on keys under "
        f"{names['stream_prefix']!r} (ACL): grant what `trtllm-worker acl` prints for "
        "trtllm-worker"
    )
    assert process.returncode == 1, stdout + err.decode()
    assert line in stdout.splitlines(), stdout
    worker = await spawn(ready=False, **worker_urls(granted))
    assert await worker.wait() == 69
    assert line.removeprefix("problem Redis: ") in worker.log()

    granted.set_redis_user("trtllm-worker", rules)  # Redis is fine again; now the broker
    dead = re.escape(names["queue"] + ".dead")
    worker = await refused_configure(granted, spawn, dead)
    user = granted.rabbitmq_user("trtllm-worker")
    # RabbitMQ 4.0 says which access: "configure access to queue ..."
    assert re.search(
        "RabbitMQ refused: ACCESS_REFUSED - (configure )?"
        + re.escape(
            f"access to queue '{names['queue']}.dead'"
            f" in vhost '{granted.vhost}' refused for user '{user}'"
        ),
        worker.log(),
    ), worker.log()
    assert "Traceback" not in worker.log()

    # its own cancel queue refused: the worker exits 69, and check names it too
    own = re.escape(names["queue"] + ".cancel") + r"\.[0-9a-f]{12}"
    worker = await refused_configure(granted, spawn, own)
    refusal = "ACCESS_REFUSED - (configure )?" + re.escape(
        f"access to queue '{names['queue']}.cancel."
    )
    assert re.search(f"RabbitMQ refused: {refusal}", worker.log()), worker.log()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trtllm_worker", "check", env=env, cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(process.communicate(), 60)
    problems = [line for line in out.decode().splitlines() if line.startswith("problem")]
    assert len(problems) == 1, out.decode()
    assert re.match(f"problem cancel queue: {refusal}", problems[0]), problems[0]


async def refused_configure(granted: Granted, spawn: Spawn, name: str) -> WorkerProcess:
    """The worker's grants less configure on `name` (a pattern part); a worker started
    under them, which must exit 69."""
    permissions = granted.grants["rabbitmq"]["trtllm-worker"]
    configure = permissions["configure"].replace("|" + name, "")
    assert configure != permissions["configure"]
    granted.set_permissions("trtllm-worker", configure, permissions["write"], permissions["read"])
    worker = await spawn(ready=False, **worker_urls(granted))
    try:
        assert await worker.wait() == 69
    except TimeoutError:
        raise AssertionError(worker.log()) from None
    return worker


def test_resource_names_with_regex_characters_are_escaped(names: dict[str, str]) -> None:
    grants = acl_json(names, WORKER_QUEUE="jobs.v1", WORKER_STREAM_PREFIX="llm[a]*:")
    worker = grants["rabbitmq"]["trtllm-worker"]
    assert re.fullmatch(worker["configure"], "jobs.v1.dead")
    assert not re.fullmatch(worker["configure"], "jobsXv1.dead")
    assert not re.fullmatch(worker["configure"], "jobs.v1Xdead")
    assert "~llm\\[a\\]\\*:*" in grants["redis"]["trtllm-worker"]


async def cli(granted: Granted, names: dict[str, str], role: str, *args: str) -> tuple[int, str]:
    """`trtllm-worker ARGS` as `role` (its AMQP and Redis users); exit code, output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env.update(
        WORKER_QUEUE=names["queue"], WORKER_STREAM_PREFIX=names["stream_prefix"],
        WORKER_AMQP_URL=granted.amqp_url(role), WORKER_REDIS_URL=granted.redis_url(role),
    )  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trtllm_worker", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode()


async def test_the_admin_commands_run_under_the_admin_grants(
    granted: Granted,
    as_roles: tuple[Producer, Subscriber, Producer],
    names: dict[str, str],
    spawn: Spawn,
) -> None:
    """cancel, dead-letters and --requeue as trtllm-admin; a producer's CLI submit as
    trtllm-producer (its Redis user: the subscriber's, for --follow)."""
    producer, subscriber, _ = as_roles
    await spawn(WORKER_ECHO_STEP_MS="10", **worker_urls(granted))
    dead_id = rid()
    await producer.publish({"request_id": dead_id, "inputs": "x", "parameters": {
        "max_new_tokens": 10**6}})  # fmt: skip
    assert terminal(await subscriber.read_until_terminal(dead_id))["event"] == "error"
    code, out = await cli(granted, names, "trtllm-admin", "dead-letters")
    assert code == 0, out
    assert dead_id in out
    code, out = await cli(granted, names, "trtllm-admin", "dead-letters", "--requeue")
    assert code == 0, out
    # the requeued job ran again (and, still invalid, ended the same way)
    assert terminal(await subscriber.read_until_terminal(dead_id))["event"] == "error"

    long_id = rid()
    await producer.publish({"request_id": long_id, "inputs": "x", "parameters": {
        "max_new_tokens": 2000}})  # fmt: skip
    await wait_for_entries(subscriber, long_id, 3)
    code, out = await cli(granted, names, "trtllm-admin", "cancel", long_id)
    assert code == 0, out
    done = terminal(await subscriber.read_until_terminal(long_id))
    assert done["finish_reason"] == "cancelled"


async def test_a_classic_queue_under_the_grants(
    granted: Granted, as_roles: tuple[Producer, Subscriber, Producer], spawn: Spawn
) -> None:
    """Classic queues count redeliveries in Redis (INCRBY on the side key): granted
    too. The first worker's engine dies on the job and hands it back; the second counts
    the redelivery and runs it."""
    producer, subscriber, _ = as_roles
    crashing = await spawn(
        WORKER_QUEUE_TYPE="classic", WORKER_ECHO_CRASH_TOKEN_ID="255", **worker_urls(granted)
    )
    request_id = rid()
    await producer.publish(
        {"request_id": request_id, "input_ids": [99, 255], "parameters": {"max_new_tokens": 9}}
    )
    assert await crashing.wait() == 3
    await spawn(WORKER_QUEUE_TYPE="classic", **worker_urls(granted))
    done = terminal(await subscriber.read_until_terminal(request_id))
    assert (done["event"], done["generated_tokens"]) == ("done", "9")
    root = aioredis.Redis(port=granted.redis_port, decode_responses=True)
    try:
        key = "{" + subscriber.key(request_id) + "}:deliveries"
        assert await root.get(key) == "1"  # the redelivery counted, as its own user
        assert "errorstat_NOPERM" not in await root.info("errorstats")
    finally:
        await root.aclose()


def test_acl_refuses_a_prefix_an_acl_pattern_cannot_hold(names: dict[str, str]) -> None:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    result = subprocess.run(
        [sys.executable, "-m", "trtllm_worker", "acl"],
        env={**environment, "WORKER_STREAM_PREFIX": "my app:"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert "WORKER_STREAM_PREFIX holds a space" in result.stderr
    assert result.stdout == ""
