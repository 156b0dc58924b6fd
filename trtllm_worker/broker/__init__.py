"""RabbitMQ: connecting (URLs, TLS), consuming jobs, settling messages, the cancel fanout."""
