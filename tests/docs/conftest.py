"""The docs' tests use the integration fixtures: a worker in this test's event loop, on
this test's own queue and stream prefix, against the real RabbitMQ and Redis."""

from tests.integration.conftest import (  # noqa: F401  (fixtures)
    amqp_channel,
    cleanup_keys,
    redis_client,
    run_gateway,
    run_worker,
)
