"""The SDK without an event loop: the same calls, blocking."""

from trtllm_worker.client import SyncClient
from trtllm_worker.config import load_settings

with SyncClient(load_settings()) as client:
    print(client.generate("Hello", {"max_new_tokens": 16}).generated_text)
    for letter in client.dead_letters():
        print(letter.request_id, letter.code, letter.message)
