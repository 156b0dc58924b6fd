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
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import aio_pika
import aiormq
import httpx
import openai
import pytest
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError

from tests.integration.conftest import (
    Producer,
    Spawn,
    SpawnGateway,
    Subscriber,
    WorkerProcess,
    terminal,
    tokens,
)
from tests.integration.test_faults import assert_exact, wait_for_entries
from tests.services import ServiceUrls
from trtllm_worker.config import Settings
from trtllm_worker.connect.redis import QUIET_HANDSHAKE
from trtllm_worker.gateway.app import create_app
from trtllm_worker.gateway.grants import PROBE_ID

ROLES_REDIS = ("trtllm-worker", "trtllm-subscriber", "trtllm-admin", "trtllm-gateway")
ROLES_RABBITMQ = ("trtllm-worker", "trtllm-producer", "trtllm-admin", "trtllm-gateway")
RABBITMQCTL_TIMEOUT_S = 60.0


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


def run_rabbitmqctl(
    *args: str, timeout_s: float = RABBITMQCTL_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """`rabbitmqctl ARGS` in a process group of its own: one that does not answer within
    `timeout_s` is killed whole (the script and the Erlang VM it runs), never left
    hanging, and raises `TimeoutError`."""
    process = subprocess.Popen(
        ["rabbitmqctl", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.communicate(timeout=10)
        raise TimeoutError(
            f"rabbitmqctl {args[0]}: no answer within {timeout_s:.0f}s (killed)"
        ) from None
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def rabbitmqctl(*args: str) -> str:
    result = run_rabbitmqctl(*args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def removed(*args: str) -> str | None:
    """`rabbitmqctl delete_… NAME`: None once it is gone (deleted now, or never made),
    else why not. Never raises: every removal of a teardown is tried."""
    try:
        result = run_rabbitmqctl(*args)
    except (TimeoutError, OSError) as exc:
        return str(exc)
    gone = ("does not exist", "no_such_user", "no_such_vhost")
    if result.returncode == 0 or any(word in result.stderr + result.stdout for word in gone):
        return None
    return f"rabbitmqctl {' '.join(args)}: {result.stderr.strip()}"


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
            made.append(user)  # before: an add_user cut short may have made it
            rabbitmqctl("add_user", user, state.passwords[role])
            state.set_permissions(
                role, permissions["configure"], permissions["write"], permissions["read"]
            )
        yield state
    finally:
        for role in grants["redis"]:  # gone with the server too; deleted first all the same
            with contextlib.suppress(subprocess.TimeoutExpired):
                subprocess.run(
                    ["redis-cli", "-p", str(port), "ACL", "DELUSER", role],
                    capture_output=True, timeout=10, check=False,
                )  # fmt: skip
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
        # the vhost goes with every queue and exchange the test's processes declared in it
        left = [removed("delete_vhost", vhost)]
        left += [removed("delete_user", user) for user in made]
        problems = [problem for problem in left if problem is not None]
        assert not problems, problems


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
        refusals = await root.acl_log()  # also a script's refused call that it handled
    finally:
        await root.aclose()
    assert "errorstat_NOPERM" not in stats, stats
    assert refusals == []


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
    # the gateway's keys are narrower: streams, its files and batches, its stream
    # reader's wake stream, three side keys (never the usage counters or a delivery count)
    key_patterns = {
        "trtllm-gateway": {
            f"{prefix}[A-Za-z0-9]*", f"{prefix}_file:*", f"{prefix}_batch:*",
            f"{prefix}_batches", f"{prefix}_gateway:*", f"{{{prefix}*}}:cancel",
            f"{{{prefix}*}}:batch", f"{{{prefix}*}}:lease",
        },
    }  # fmt: skip
    for user, rules in grants["redis"].items():
        assert rules[:4] == ["reset", "on", ">PASSWORD", "resetchannels"], user
        for rule in rules[4:]:
            assert not rule.startswith(("+@", "allkeys", "allcommands", "allchannels", "&")), rule
            assert rule not in ("~*", "%R~*", "%W~*", "+@all"), rule
            if rule.startswith(("~", "%R~")):
                pattern = rule.split("~", 1)[1]
                allowed_keys = key_patterns.get(user, {f"{prefix}*", f"{{{prefix}*}}:*"})
                assert pattern in allowed_keys, rule
            else:
                assert rule.startswith("+"), rule
                assert not any(word in rule for word in forbidden), rule
    assert grants["redis"]["trtllm-subscriber"][4] == f"%R~{prefix}*"  # read only
    assert "+xadd" not in grants["redis"]["trtllm-subscriber"]
    assert not {"+eval", "+scan", "+keys", "+type", "+xtrim"} & set(
        grants["redis"]["trtllm-gateway"]
    )
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
    for role in ("trtllm-producer", "trtllm-gateway"):
        permissions = grants["rabbitmq"][role]
        assert permissions["configure"] == permissions["read"] == "^$", role


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
        assert await root.acl_log() == []
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


async def batch_cli(
    granted: Granted, names: dict[str, str], role: str, *args: str
) -> tuple[int, str, str]:
    """`trtllm-worker batch ARGS` as `role`; exit code, stdout, stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env.update(
        WORKER_QUEUE=names["queue"], WORKER_STREAM_PREFIX=names["stream_prefix"],
        WORKER_AMQP_URL=granted.amqp_url(role), WORKER_REDIS_URL=granted.redis_url(role),
    )  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trtllm_worker", "batch", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def completion_lines(prefix: str, count: int, max_tokens: int) -> str:
    return "".join(
        json.dumps({"custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"model": "echo", "prompt": f"{prefix} {i} ",
                             "max_tokens": max_tokens}}) + "\n"
        for i in range(count)
    )  # fmt: skip


async def test_batches_run_under_the_admin_grants(
    granted: Granted, names: dict[str, str], spawn: Spawn, tmp_path: Path
) -> None:
    """submit, status, results, list and cancel, from the CLI as trtllm-admin (Redis and
    RabbitMQ), the worker as trtllm-worker: every command each runs is granted (a refusal
    the code swallows, a cancel mark, still counts in Redis's error stats)."""
    admin = "trtllm-admin"
    # 4 lines at a time: a cancel ends the queued ones itself (the write script)
    worker = await spawn(WORKER_ECHO_STEP_MS="10", WORKER_MAX_BATCH="4", **worker_urls(granted))
    short = tmp_path / "short.jsonl"
    short.write_text(completion_lines("short", 12, 3) + '{"custom_id": "bad"}\n')
    code, out, err = await batch_cli(granted, names, admin, "submit", str(short),
                                     "--id", "acl-short", "--wait")  # fmt: skip
    assert (code, out.strip()) == (0, "acl-short"), err
    code, out, err = await batch_cli(granted, names, admin, "status", "acl-short")
    assert code == 0, err
    status = json.loads(out)
    assert status["status"] == "completed"
    assert status["request_counts"] == {"total": 13, "completed": 12, "failed": 1}
    output, errors = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    code, out, err = await batch_cli(granted, names, admin, "results", "acl-short",
                                     "-o", str(output), "--errors", str(errors))  # fmt: skip
    assert code == 0, err
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == [f"short-{i}" for i in range(12)]
    assert len(errors.read_text().splitlines()) == 1

    slow = tmp_path / "slow.jsonl"
    slow.write_text(completion_lines("slow", 20, 2000))
    code, out, err = await batch_cli(granted, names, admin, "submit", str(slow),
                                     "--id", "acl-slow")  # fmt: skip
    assert code == 0, err
    root = aioredis.Redis(port=granted.redis_port, decode_responses=True)
    try:
        # one line running: the cancel meets started and queued lines
        await wait_for_entries(Subscriber(root, names["stream_prefix"]), "acl-slow:0", 2)
        # no worker left to load the write script again: the cancel loads it itself
        # (NOSCRIPT), ends the queued lines and marks the started ones, which the next
        # worker ends as cancelled
        worker.signal(signal.SIGKILL)
        assert await worker.wait() == -signal.SIGKILL
        await root.script_flush()
        code, out, err = await batch_cli(granted, names, admin, "cancel", "acl-slow")
        assert code == 0, err
        assert json.loads(out)["status"] == "cancelling"
        await spawn(WORKER_ECHO_STEP_MS="10", **worker_urls(granted))
        code, out, err = await batch_cli(granted, names, admin, "wait", "acl-slow")
        cancelled = json.loads(out)
        assert cancelled["status"] == "cancelled", err
        assert cancelled["request_counts"] == {"total": 20, "completed": 0, "failed": 20}
        last = names["stream_prefix"] + "acl-slow:19"  # never taken: ended by the cancel
        ended = cast(list[tuple[str, dict[str, str]]], await root.xrange(last))
        assert [fields for _, fields in ended] == [
            {"event": "done", "finish_reason": "cancelled", "generated_tokens": "0",
             "input_tokens": "0", "generated_text": ""}
        ]  # fmt: skip
        code, out, err = await batch_cli(granted, names, admin, "list")
        assert code == 0, err
        assert {json.loads(line)["id"] for line in out.splitlines()} == {"acl-slow", "acl-short"}
        # a refusal the code would swallow (a cancel mark) still counts here; one the
        # write script handles itself (its pcalls: XLEN, GET) only in the ACL log
        assert "errorstat_NOPERM" not in await root.info("errorstats")
        assert await root.acl_log() == []
    finally:
        await root.aclose()


# -- the gateway ----------------------------------------------------------------------------

TEMPLATE = Path(__file__).parents[1] / "fixtures" / "chat_templates" / "qwen2.5.jinja"
MODEL = "tiny-echo"
SERVED = {"WORKER_CHAT_TEMPLATE": str(TEMPLATE), "WORKER_MODEL_NAME": MODEL}


def gateway_urls(granted: Granted) -> dict[str, str]:
    return {
        "WORKER_AMQP_URL": granted.amqp_url("trtllm-gateway"),
        "WORKER_REDIS_URL": granted.redis_url("trtllm-gateway"),
    }


def chat_lines(prefix: str, count: int, max_tokens: int) -> bytes:
    return "".join(
        json.dumps({"custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": MODEL, "max_tokens": max_tokens,
                             "messages": [{"role": "user", "content": f"{prefix} {i}"}]}}) + "\n"
        for i in range(count)
    ).encode()  # fmt: skip


async def batch_reaches(
    client: openai.AsyncOpenAI, batch_id: str, status: str, wait_s: float = 60
) -> openai.types.Batch:
    """Polls the batch (each poll may move it on: finalize, expire) until `status`."""
    async with asyncio.timeout(wait_s):
        while True:
            batch = await client.batches.retrieve(batch_id)
            if batch.status == status:
                return batch
            assert batch.status in ("validating", "in_progress", "finalizing", "cancelling"), batch
            await asyncio.sleep(0.2)


@pytest.mark.timeout(180)
async def test_the_gateway_serves_under_its_grants(
    granted: Granted, names: dict[str, str], spawn: Spawn, spawn_gateway: SpawnGateway
) -> None:
    """A gateway process as trtllm-gateway (a depth limit set: every request asks the
    queue's depth, a passive declare), driven by the `openai` package: a chat answer
    whole and streamed, its stream from /v1/streams, a client that leaves mid-answer
    (its job ends cancelled), a batch run and read back, another cancelled with its
    lines queued (ended by the write script, which the gateway loads on NOSCRIPT). The
    worker runs as trtllm-worker. Nothing was refused: Redis's error stats count even a
    refusal the code swallows."""
    worker = await spawn(WORKER_ECHO_STEP_MS="10", WORKER_MAX_BATCH="2", **SERVED,
                         **worker_urls(granted))  # fmt: skip
    gateway = await spawn_gateway(WORKER_GATEWAY_MAX_QUEUED="1000", **SERVED,
                                  **gateway_urls(granted))  # fmt: skip
    root = aioredis.Redis(port=granted.redis_port, decode_responses=True)
    subscriber = Subscriber(root, names["stream_prefix"])
    client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}", timeout=30)
    try:
        messages: Any = [{"role": "user", "content": "granted, whole"}]
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=8
        )
        whole, request_id = raw.parse(), raw.headers["x-request-id"]
        done = terminal(await subscriber.read_until_terminal(request_id))
        assert whole.choices[0].message.content == done["generated_text"]
        assert whole.usage is not None
        assert whole.usage.completion_tokens == 8

        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == done["generated_text"]  # the echo engine: the same prompt, the same text
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 8

        stored = cast(
            list[tuple[str, dict[str, str]]], await root.xrange(subscriber.key(request_id))
        )
        assert await sse_events(http, request_id) == stored
        after_end = await http.get(
            f"/v1/streams/{request_id}", headers={"Last-Event-ID": stored[-1][0]}
        )
        assert after_end.status_code == 204  # it read the stream's end (XREVRANGE)

        body = {"model": MODEL, "prompt": "a long answer", "max_tokens": 2000, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            left_id = response.headers["x-request-id"]
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    break  # the job runs; the client leaves
        left = terminal(await subscriber.read_until_terminal(left_id))
        assert left["finish_reason"] == "cancelled"  # the cancel mark and the broadcast

        uploaded = await client.files.create(
            file=("in.jsonl", chat_lines("ok", 3, 4) + b'{"custom_id": "bad"}\n'),
            purpose="batch",
        )
        batch = await client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        completed = await batch_reaches(client, batch.id, "completed")
        assert completed.request_counts is not None
        assert (completed.request_counts.completed, completed.request_counts.failed) == (3, 1)
        assert completed.output_file_id is not None
        assert completed.error_file_id is not None
        output = (await client.files.content(completed.output_file_id)).text.splitlines()
        assert [json.loads(line)["custom_id"] for line in output] == ["ok-0", "ok-1", "ok-2"]
        errors = (await client.files.content(completed.error_file_id)).text.splitlines()
        assert [json.loads(line)["custom_id"] for line in errors] == ["bad"]
        assert (await client.files.content(uploaded.id)).content.startswith(b'{"custom_id"')

        slow = await client.files.create(file=("slow.jsonl", chat_lines("slow", 10, 2000)),
                                         purpose="batch")  # fmt: skip
        cancelled = await client.batches.create(
            input_file_id=slow.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        await batch_reaches(client, cancelled.id, "in_progress")
        # two lines run (WORKER_MAX_BATCH), the others wait in the queue
        await wait_for_entries(subscriber, f"{cancelled.id}:0", 2)
        await root.script_flush()  # the gateway's write script: loaded by the gateway itself
        assert (await client.batches.cancel(cancelled.id)).status in ("cancelling", "cancelled")
        ended = await batch_reaches(client, cancelled.id, "cancelled")
        assert ended.request_counts is not None
        assert (ended.request_counts.completed, ended.request_counts.failed) == (0, 10)
        untaken = cast(
            list[tuple[str, dict[str, str]]],
            await root.xrange(subscriber.key(f"{cancelled.id}:9")),
        )
        assert [fields["finish_reason"] for _, fields in untaken] == ["cancelled"]

        listed = await client.batches.list(limit=10)
        assert {batch.id, cancelled.id} <= {b.id for b in listed.data}
        assert [f.id async for f in client.files.list()] == [slow.id, uploaded.id]
        assert [f.id async for f in client.files.list(order="asc")] == [uploaded.id, slow.id]
        for file_id in (uploaded.id, slow.id):
            assert (await client.files.delete(file_id)).deleted
        with pytest.raises(openai.NotFoundError):
            await client.files.retrieve(uploaded.id)

        stats = await root.info("errorstats")
        assert "errorstat_NOPERM" not in stats, stats
        # a script's refused call that it handled (pcall) counts only here
        assert await root.acl_log() == []
    finally:
        print(gateway.log())  # shown when the test fails
        await client.close()
        await http.aclose()
        await root.aclose()
    for log in (gateway.log(), worker.log()):
        for refusal in ("NOPERM", "ACCESS_REFUSED", "Traceback"):
            assert refusal not in log, log


async def sse_events(http: httpx.AsyncClient, request_id: str) -> list[tuple[str, dict[str, str]]]:
    """`/v1/streams/{request_id}` as (entry id, fields) until the response ends."""
    events: list[tuple[str, dict[str, str]]] = []
    entry_id = ""
    async with http.stream("GET", f"/v1/streams/{request_id}") as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("id:"):
                entry_id = line[3:].strip()
            elif line.startswith("data:"):
                events.append((entry_id, json.loads(line[5:])))
    return events


async def test_the_gateway_is_refused_what_it_must_not_do(
    granted: Granted, names: dict[str, str], spawn: Spawn
) -> None:
    """No key beyond its own, none of the usage counters, no delivery count, no command
    beyond those named; on the broker no queue to consume, take from or
    declare (but the passive declare that reads the queue's depth answers)."""
    await spawn(**worker_urls(granted))  # the worker declares its queues
    prefix = names["stream_prefix"]
    stream = prefix + "r1"
    root = aioredis.Redis(port=granted.redis_port, decode_responses=True)
    await root.set("other-app:secret", "s3cret")
    await root.xadd(stream, {"event": "token"})
    as_gateway = aioredis.Redis.from_url(
        granted.redis_url("trtllm-gateway"), decode_responses=True, **QUIET_HANDSHAKE
    )
    try:
        for refused in (
            as_gateway.get("other-app:secret"),
            as_gateway.hincrby(prefix + "_usage:2026-01-01", "jobs:-", 1),
            as_gateway.hgetall(prefix + "_usage:2026-01-01"),
            as_gateway.set("{" + stream + "}:deliveries", "0"),
            as_gateway.xrange("other-app:stream"),
            as_gateway.eval("return 1", 0),
            as_gateway.scan(),
            as_gateway.keys("*"),
            as_gateway.type(stream),
            as_gateway.xtrim(stream, maxlen=0),
            as_gateway.flushall(),
            as_gateway.config_get("*"),
            as_gateway.script_flush(),
            as_gateway.publish("channel", "x"),
            as_gateway.acl_list(),
        ):
            with pytest.raises(NoPermissionError):
                await refused
        # what it may do
        assert await as_gateway.exists("{" + stream + "}:lease") == 0  # the fence
        tail = cast(list[tuple[str, dict[str, str]]], await as_gateway.xrevrange(stream, count=1))
        assert len(tail) == 1
        assert await as_gateway.set("{" + stream + "}:cancel", "1", ex=60)
        assert "errorstat_NOPERM" in await root.info("errorstats")  # the refusals counted
    finally:
        for client in (root, as_gateway):
            await client.aclose()

    connection = await aio_pika.connect(granted.amqp_url("trtllm-gateway"))
    try:
        depth = await (await connection.channel()).declare_queue(names["queue"], passive=True)
        assert depth.declaration_result.message_count == 0
        for attempt in (consume_jobs, declare_another_queue, take_dead_letters,
                        declare_the_job_queue):  # fmt: skip
            channel = await connection.channel()
            with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
                await attempt(channel, names["queue"])
    finally:
        await connection.close()


async def declare_the_job_queue(channel: aio_pika.abc.AbstractChannel, queue: str) -> None:
    await channel.declare_queue(queue, durable=True, arguments={"x-queue-type": "quorum"})


def test_a_rabbitmqctl_that_hangs_is_killed_with_its_children(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in `rabbitmqctl` that starts a child and never answers: the call gives up
    after its timeout, and neither the script nor its child is left running."""
    child_pid = tmp_path / "child.pid"
    stand_in = tmp_path / "rabbitmqctl"
    stand_in.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {child_pid}\nwait\n")
    stand_in.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="rabbitmqctl status: no answer within 1s"):
        run_rabbitmqctl("status", timeout_s=1)
    assert time.monotonic() - started < 15
    pid = int(child_pid.read_text())
    deadline = time.monotonic() + 5
    while _running(pid):
        assert time.monotonic() < deadline, f"the stand-in's child {pid} still runs"
        time.sleep(0.05)


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed and waiting for its reaper, does not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_a_missing_gateway_grant_is_one_line_and_the_gateway_exits_69(
    granted: Granted,
    names: dict[str, str],
    spawn_gateway: SpawnGateway,
    make_settings: Callable[..., Settings],
) -> None:
    """Two commands and one key pattern taken from trtllm-gateway: the gateway names the
    commands at start and exits 69 (as the worker does), instead of answering 500 when a
    request first needs one (a batch's cancel may come days later); `/readyz` names them
    too (a gateway that found Redis away at start probes there)."""
    prefix = names["stream_prefix"]
    rules = list(granted.grants["redis"]["trtllm-gateway"])
    fewer = [r for r in rules if r not in ("+rpush", "+hsetnx")]
    granted.set_redis_user("trtllm-gateway", fewer)
    gateway = await spawn_gateway(ready=False, **SERVED, **gateway_urls(granted))
    assert await asyncio.wait_for(gateway.process.wait(), 60) == 69, gateway.log()
    line = (
        f"Redis user 'trtllm-gateway' may not run RPUSH, HSETNX on keys under {prefix!r} "
        "(ACL): grant what `trtllm-worker acl` prints for trtllm-gateway"
    )
    assert f"trtllm-worker: {line}" in gateway.log().splitlines(), gateway.log()
    assert "Traceback" not in gateway.log()

    cancel_marks = next(r for r in rules if r.endswith("}:cancel"))
    granted.set_redis_user("trtllm-gateway", [r for r in rules if r != cancel_marks])
    app = create_app(make_settings(**{k.removeprefix("WORKER_").lower(): v
                                      for k, v in gateway_urls(granted).items()}))  # fmt: skip
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            ready = await http.get("/readyz")
    finally:
        await app.state.gateway.aclose()
    assert ready.status_code == 503
    # the commands that remove keys are probed first (were they refused, a probe would
    # leave its keys behind): there the pattern's loss shows
    assert ready.text == f"not ready: {line.replace('RPUSH, HSETNX', 'EXPIRE, DEL')}\n"
    root = aioredis.Redis(port=granted.redis_port)
    try:
        left = [key async for key in root.scan_iter(match=f"*{PROBE_ID}*")]
    finally:
        await root.aclose()
    assert left == [], "the probes left keys behind"
