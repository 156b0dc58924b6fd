"""Operations: logs, metrics, the HTTP probes, `check`, and task supervision."""
