"""Engines behind one interface; `engine_factory` picks one from the settings. The
TensorRT-LLM engines (and `tensorrt_llm` itself) are imported only when chosen."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from trtllm_worker.config import Settings
from trtllm_worker.contract.errors import ConfigError
from trtllm_worker.contract.exits import Unavailable
from trtllm_worker.engine import versions
from trtllm_worker.engine.base import Engine
from trtllm_worker.engine.echo import EchoEngine
from trtllm_worker.engine.lora import Adapters
from trtllm_worker.tokenizer import TokenizerInfo

INSTALL_HINT = (
    f"install TensorRT-LLM from NVIDIA's index (pip install '{versions.REQUIREMENT}' "
    "--extra-index-url https://pypi.nvidia.com, on Python 3.10/3.12 with an NVIDIA driver), "
    "or run the worker's GPU image built on NVIDIA's TensorRT-LLM release container"
)


class EngineStartTimeout(Unavailable):
    """The engine did not come up within WORKER_ENGINE_START_TIMEOUT_S."""


def engine_factory(
    settings: Settings, tokenizer: TokenizerInfo, adapters: Adapters | None = None
) -> Callable[[], Engine]:
    """A callable that builds the engine (slow for TensorRT-LLM: it loads the model),
    with LoRA enabled for `adapters` where the engine serves them (the LLM API)."""
    if settings.engine == "echo":
        return lambda: EchoEngine(
            capacity=settings.max_batch,
            step_s=settings.echo_step_ms / 1000,
            tokens_per_step=settings.echo_tokens_per_step,
            fault_token=settings.echo_fault_token_id,
            crash_token=settings.echo_crash_token_id,
        )
    try:
        if settings.engine == "trtllm":
            from trtllm_worker.engine import trtllm

            return lambda: trtllm.create(settings, tokenizer, adapters)
        from trtllm_worker.engine import trtllm_executor

        return lambda: trtllm_executor.create(settings, tokenizer)
    except (ImportError, OSError) as exc:  # OSError: libcuda/libmpi missing
        raise ConfigError(
            f"invalid setting WORKER_ENGINE: {settings.engine!r} needs TensorRT-LLM, which "
            f"cannot be imported here ({exc}); {INSTALL_HINT}"
        ) from None


async def start_engine(factory: Callable[[], Engine], timeout_s: float) -> Engine:
    """Build the engine on a daemon thread, so a start-up that hangs (MPI, model load)
    fails after `timeout_s` instead of hanging the worker, and the event loop stays free."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Engine] = loop.create_future()

    def build() -> None:
        try:
            engine = factory()
        except BaseException as exc:
            loop.call_soon_threadsafe(_settle_error, future, exc)
        else:
            loop.call_soon_threadsafe(_settle_result, future, engine)

    threading.Thread(target=build, name="engine-start", daemon=True).start()
    try:
        return await asyncio.wait_for(future, timeout_s)
    except TimeoutError:
        raise EngineStartTimeout(
            f"the engine did not start within {timeout_s:.0f}s (WORKER_ENGINE_START_TIMEOUT_S)"
        ) from None


def _settle_result(future: asyncio.Future[Engine], engine: Engine) -> None:
    if future.cancelled():
        engine.shutdown()
    else:
        future.set_result(engine)


def _settle_error(future: asyncio.Future[Engine], exc: BaseException) -> None:
    if not future.cancelled():
        future.set_exception(exc)
