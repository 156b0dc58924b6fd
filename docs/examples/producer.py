"""Submit a job with the SDK, print its tokens as they arrive, then submit and wait."""

import asyncio

from trtllm_worker.client import Client, DoneEvent, ErrorEvent, JobFailed, TokenEvent
from trtllm_worker.config import load_settings


async def main() -> None:
    # the worker's own WORKER_* settings: URLs, queue, stream prefix, TLS files, limits
    async with Client(load_settings()) as client:
        request_id = await client.submit("Once upon a time", {"max_new_tokens": 16})
        async for event in client.stream(request_id):
            if isinstance(event, TokenEvent):
                print(event.text, end="", flush=True)
            elif isinstance(event, DoneEvent):
                print(f"\n{event.finish_reason}, {event.generated_tokens} tokens")
            elif isinstance(event, ErrorEvent):
                print(f"\nfailed: {event.code}: {event.message}")

        try:
            done = await client.generate("Hello", {"max_new_tokens": 8})  # submit and wait
            print(done.generated_text)
        except JobFailed as exc:
            print(exc.code, exc.message)


asyncio.run(main())
