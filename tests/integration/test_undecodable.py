"""AMQP short strings that are not UTF-8 (a property, a header key, a routing key) are
bytes like any other on the queue: the job ends in `<queue>.dead` with the reason, a
cancel is honoured, and the worker keeps its connection (issue 25, item 1: pamqp's
strict decoding used to drop it, and the broker redelivered the message forever)."""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

import pytest
from pamqp import commands

from tests.integration.conftest import Producer, Subscriber, WorkerFactory, terminal, tokens
from tests.raw_amqp import publish_raw
from tests.services import ServiceUrls
from trtllm_worker.app.service import Service

BAD = b"\xff\xfe\xc3\x28"  # not UTF-8: two invalid start bytes, then a broken pair
LOST = "broker connection lost"


def rid() -> str:
    return f"ud-{uuid.uuid4().hex[:10]}"


def amqp_link(service: Service) -> object:
    """The worker's current AMQP connection (aio-pika replaces it on a reconnect)."""
    consumer = service._consumer
    assert consumer is not None
    assert consumer._connection is not None
    transport = consumer._connection.transport
    assert transport is not None
    return transport


# property (as aio-pika names it on the received message), pamqp's keyword, placeholder
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "message_id": ("message_id", {"message_id": "@@@@"}),
    "content_type": ("content_type", {"content_type": "@@@@"}),
    "type": ("type", {"message_type": "@@@@"}),
    "app_id": ("app_id", {"app_id": "@@@@"}),
    "correlation_id": ("correlation_id", {"correlation_id": "@@@@"}),
    "reply_to": ("reply_to", {"reply_to": "@@@@"}),
    "content_encoding": ("content_encoding", {"content_encoding": "@@@@"}),
    "header-key": ("headers", {"headers": {"x-producer": "test", "@@@@": "v"}}),
    "nested-header-key": ("headers", {"headers": {"x-producer": "test", "x-n": {"@@@@": 1}}}),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_undecodable_property_is_dead_lettered_on_the_same_connection(
    run_worker: WorkerFactory,
    producer: Producer,
    subscriber: Subscriber,
    services: ServiceUrls,
    names: dict[str, str],
    caplog: pytest.LogCaptureFixture,
    case: str,
) -> None:
    field, bad_properties = CASES[case]
    running, bad, after = rid(), rid(), rid()
    properties: dict[str, Any] = {
        "content_type": "application/json",
        "correlation_id": "c-1",
        "headers": {"x-producer": "test"},
        "delivery_mode": 2,
        **bad_properties,
    }
    body = json.dumps({"request_id": bad, "inputs": "hi"}).encode()
    caplog.set_level(logging.WARNING, logger="trtllm_worker.broker.consumer")
    async with run_worker(echo_step_ms=10) as service:
        link = amqp_link(service)
        # a job in flight when the bad message comes: it is not handed back
        await producer.publish(
            {"request_id": running, "inputs": "abc", "parameters": {"max_new_tokens": 100}}
        )
        await subscriber.first_entry(running)
        await publish_raw(
            services.amqp,
            exchange="",
            routing_key=names["queue"],
            body=body,
            properties=commands.Basic.Properties(**properties),
            replacements={b"@@@@": BAD},
        )
        dead = await producer.get_dead()
        await producer.publish(
            {"request_id": after, "inputs": "ok", "parameters": {"max_new_tokens": 2}}
        )
        entries = await subscriber.read_many([running, after, bad])
        assert amqp_link(service) is link, "the worker reconnected"
    assert LOST not in caplog.text
    assert terminal(entries[after])["generated_text"] == "ok"
    done = terminal(entries[running])
    assert done["finish_reason"] == "length"
    assert len(tokens(entries[running])) == 100, "the running job ran once, start to end"
    # the bad message's own stream (its body names it) ends with the error
    error = terminal(entries[bad])
    assert error["event"] == "error"
    assert error["code"] == "invalid_request"
    # the dead letter: the reason names the property and its bytes, the copy leaves the
    # undecodable string out and keeps the rest
    assert dead.body == body
    assert dead.headers["x-error-code"] == "invalid_request"
    reason = str(dead.headers["x-error-message"])
    assert field in reason
    assert repr(BAD)[2:-1] in reason, reason
    assert dead.headers["x-producer"] == "test"
    if field == "headers":
        assert all("\udcff" not in key for key in dead.headers)
        if case == "nested-header-key":
            assert dead.headers["x-n"] == {}
    else:
        value = getattr(dead, field)
        # left out (aiormq gives a mandatory publish without a message_id a random one)
        assert value is None or (field == "message_id" and value.isascii()), value
    if field != "correlation_id":
        assert dead.correlation_id == "c-1"
    if field != "content_type":
        assert dead.content_type == "application/json"


async def test_cancel_with_undecodable_strings_keeps_every_connection(
    run_worker: WorkerFactory,
    producer: Producer,
    subscriber: Subscriber,
    services: ServiceUrls,
    names: dict[str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A cancel whose properties, header keys and routing key are not UTF-8 (the fanout
    ignores the routing key, so the broker delivers it to every worker) is honoured for
    its valid body; a later valid cancel still works."""
    first, second = rid(), rid()
    caplog.set_level(logging.WARNING, logger="trtllm_worker.broker.consumer")
    async with run_worker(echo_step_ms=10) as service:
        link = amqp_link(service)
        for request_id in (first, second):
            await producer.publish(
                {"request_id": request_id, "inputs": "abc", "parameters": {"max_new_tokens": 2000}}
            )
            await subscriber.first_entry(request_id)
        await publish_raw(
            services.amqp,
            exchange=f"{names['queue']}.cancel",
            routing_key="@@@1",
            body=json.dumps({"request_id": first}).encode(),
            properties=commands.Basic.Properties(
                message_id="@@@2", message_type="@@@3", headers={"@@@4": "v"}
            ),
            replacements={b"@@@1": BAD, b"@@@2": BAD, b"@@@3": BAD, b"@@@4": BAD},
        )
        cancelled = await subscriber.read_until_terminal(first)
        await producer.cancel(second)
        later = await subscriber.read_until_terminal(second)
        assert amqp_link(service) is link, "the worker reconnected"
    assert LOST not in caplog.text
    for entries in (cancelled, later):
        done = terminal(entries)
        assert done["finish_reason"] == "cancelled"
        assert 1 <= int(done["generated_tokens"]) < 2000
