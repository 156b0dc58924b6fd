"""Engines behind one interface; `create_engine` picks one from the settings."""

from __future__ import annotations

from worker.config import Settings
from worker.engine.base import Engine
from worker.engine.echo import EchoEngine
from worker.errors import ConfigError


def create_engine(settings: Settings) -> Engine:
    """Build the engine the settings name. TensorRT-LLM engines are imported lazily."""
    if settings.engine == "echo":
        return EchoEngine(capacity=settings.max_batch, step_s=settings.echo_step_ms / 1000)
    raise ConfigError(
        f"invalid setting WORKER_ENGINE: {settings.engine!r} is not available in this build "
        "(TensorRT-LLM engines are not implemented yet; use 'echo')"
    )
