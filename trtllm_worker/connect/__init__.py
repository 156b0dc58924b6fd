"""The transports, for the worker, the SDK and the CLI alike: the one place a RabbitMQ
(`amqp`) or Redis (`redis`) client is built (URLs, clusters, Sentinel, TLS), the AMQP
message helpers both sides share (`messages`, the pamqp guard `shortstr`), and the
grants each role's clients need (`grants`)."""
