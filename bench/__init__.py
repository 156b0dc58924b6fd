"""trtllm-worker's benchmark: real worker processes (echo engine standing in for a GPU),
jobs published through RabbitMQ with publisher confirms, every stream read with XREAD as
a subscriber does.

`settings` (where results go, what to compare with), `procfs` (a process's CPU and
memory from /proc), `services` (what the bench starts beside the worker: a Redis Cluster,
an OTLP sink, a baseline checkout; redis-benchmark's XADD rate), `readers` (the
subscriber's XREAD), `harness` (one worker through one workload), `scenarios` (what is
measured, each with its target), `report` (JSON, plots, SUMMARY.md), `cli` (`make bench`);
for the `gateway` scenario, `gateway_load` (its load generator, a process of its own),
`sse_client` (its streaming HTTP client) and `gateway_stats` (its arithmetic).
"""
