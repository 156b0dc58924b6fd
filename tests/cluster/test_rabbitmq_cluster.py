"""A real 3-node RabbitMQ cluster (tools/rabbitmq-cluster.sh, as `make cluster-up`
starts it): the node holding the workers' connections is stopped mid-run, and the
quorum queue, the lease and the resume keep every job, each index once."""

from __future__ import annotations

import asyncio
import socket
import uuid

import aio_pika
import pytest
import redis.asyncio as aioredis

from tests.cluster.conftest import RabbitCluster, assert_complete
from tests.integration.conftest import Producer, Spawn, Subscriber
from tests.integration.test_faults import DROPPED, MOVED, wait_for_entries

pytestmark = pytest.mark.cluster

JOBS, TOKENS = 200, 100


def connection_nodes(cluster: RabbitCluster, port: int, pids: list[int]) -> dict[int, str]:
    """The node each worker process's connection is on (connection names carry the pid;
    a connection's Erlang pid names its node)."""
    listing = cluster.ctl(port, "list_connections", "pid", "client_properties")
    nodes: dict[int, str] = {}
    for line in listing.splitlines():
        connection, _, properties = line.partition("\t")
        for pid in pids:
            if f'"trtllm-worker {socket.gethostname()}:{pid}:' in properties:
                nodes[pid] = connection.strip("<>").split(".")[0]
    return nodes


def queue_info(cluster: RabbitCluster, port: int, queue: str) -> dict[str, str]:
    listing = cluster.ctl(port, "list_queues", "name", "type", "leader", "members")
    for line in listing.splitlines():
        fields = line.split("\t")
        if fields[0] == queue:
            return dict(zip(("name", "type", "leader", "members"), fields, strict=True))
    raise AssertionError(f"no queue {queue} in {listing}")


async def test_the_node_holding_the_connections_stopped_mid_run(
    rabbitmq_cluster: RabbitCluster,
    spawn: Spawn,
    subscriber: Subscriber,
    redis_client: aioredis.Redis,
    names: dict[str, str],
) -> None:
    cluster = rabbitmq_cluster
    first, second, third = cluster.ports
    urls = ",".join(cluster.url(port) for port in cluster.ports)
    # two workers, 16 jobs at a time each, 2 s a job: work in hand when the node goes
    workers = [
        await spawn(WORKER_AMQP_URL=urls, WORKER_ECHO_STEP_MS="20", WORKER_MAX_BATCH="16")
        for _ in range(2)
    ]
    pids = [worker.pid for worker in workers]
    assert connection_nodes(cluster, second, pids) == dict.fromkeys(pids, cluster.node(first))
    queue = queue_info(cluster, second, names["queue"])
    assert queue["type"] == "quorum", queue
    assert queue["members"].count("trtw-") == 3, "the queue has a member on every node"

    connection = await aio_pika.connect(cluster.url(second))  # the producer's own node
    try:
        producer = Producer(await connection.channel(), names["queue"])
        jobs = {f"rmq-{uuid.uuid4().hex[:10]}": f"job {n:03d} " for n in range(JOBS)}
        for request_id, prompt in jobs.items():
            await producer.publish(
                {"request_id": request_id, "inputs": prompt,
                 "parameters": {"max_new_tokens": TOKENS}}
            )  # fmt: skip
        await wait_for_entries(subscriber, next(iter(jobs)), 5)

        await asyncio.to_thread(cluster.stop, first)
        assert not cluster.answers(first), "the node is down"
        await assert_complete(redis_client, names["stream_prefix"], jobs, TOKENS)
    finally:
        await connection.close()

    dropped = [int(n) for worker in workers for n in DROPPED.findall(worker.log())]
    assert sum(dropped) > 0, "jobs were in flight on the connections that were lost"
    for worker in workers:
        moves = MOVED.findall(worker.log())
        assert moves, "the worker moved to another node"
        assert moves[0][0] == f"127.0.0.1:{first}", moves
    now = connection_nodes(cluster, second, pids)
    assert set(now) == set(pids), "both workers consume again"
    assert cluster.node(first) not in now.values(), now
    leader = queue_info(cluster, second, names["queue"])["leader"]
    assert leader in (cluster.node(second), cluster.node(third)), leader
