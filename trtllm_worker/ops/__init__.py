"""Observability and supervision: logs, metrics, traces, the HTTP probes, task supervision."""
