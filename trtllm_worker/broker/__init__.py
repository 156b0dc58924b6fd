"""RabbitMQ, the worker's side: consuming jobs, settling messages, the cancel fanout."""
