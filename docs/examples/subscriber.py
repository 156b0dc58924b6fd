"""Read one request's stream with plain redis-py, from its first entry to its end."""

import os
import sys

import redis

request_id = sys.argv[1]
key = os.environ.get("WORKER_STREAM_PREFIX", "gen:") + request_id
r = redis.Redis.from_url(
    os.environ.get("WORKER_REDIS_URL", "redis://localhost:6379/0"), decode_responses=True
)

last_id = "0"  # from the start: never "$", which misses what came before
while True:
    # block (ms) stays below the client's socket timeout
    for _, entries in r.xread({key: last_id}, block=5000) or []:
        for entry_id, fields in entries:
            last_id = entry_id  # a reader that reconnects resumes after it
            if fields["event"] == "token":
                print(fields["text"], end="", flush=True)
            elif fields["event"] in ("done", "error"):
                print("\n", fields)
                raise SystemExit
