#!/usr/bin/env bash
# The gateway with curl: one answer whole, one streamed, then the streamed one read again
# from its job's stream, after its third entry (as a reconnecting client would).
set -euo pipefail
GATEWAY=${GATEWAY:-http://localhost:8000}
KEY=${KEY:-sk-local}

curl -sS "$GATEWAY/v1/completions" \
    -H "Authorization: Bearer $KEY" -H "Content-Type: application/json" \
    -d '{"model": "echo", "prompt": "Hello", "max_tokens": 8}' \
    | python3 -c 'import json, sys; print(json.load(sys.stdin)["choices"][0]["text"])'

# -D: the headers, for x-request-id (the job's id); -N: print the events as they come
curl -sSN -D headers.txt "$GATEWAY/v1/completions" \
    -H "Authorization: Bearer $KEY" -H "Content-Type: application/json" \
    -d '{"model": "echo", "prompt": "Once upon a time", "max_tokens": 16, "stream": true}' \
    | grep -c '^data: {' # chunks: one per token, then the finish chunk
request_id=$(tr -d '\r' < headers.txt | awk -F': ' 'tolower($1) == "x-request-id" {print $2}')

third=$(curl -sS "$GATEWAY/v1/streams/$request_id" -H "Authorization: Bearer $KEY" \
    | grep '^id: ' | sed -n 3p | cut -c5- | tr -d '\r')
curl -sS "$GATEWAY/v1/streams/$request_id" -H "Authorization: Bearer $KEY" \
    -H "Last-Event-ID: $third" \
    | python3 -c '
import json, sys
entries = [json.loads(line[6:]) for line in sys.stdin if line.startswith("data: ")]
print(len(entries), "entries after the third, the last:", entries[-1]["event"])
'
