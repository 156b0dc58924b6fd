#!/usr/bin/env bash
# An OpenAI Batch file through the queue: submit, wait, fetch the output and error files.
set -euo pipefail

cat > requests.jsonl <<'LINES'
{"custom_id": "greeting", "method": "POST", "url": "/v1/completions", "body": {"model": "echo", "prompt": "Hello", "max_tokens": 8}}
{"custom_id": "story", "method": "POST", "url": "/v1/completions", "body": {"model": "echo", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}}
{"custom_id": "three", "method": "POST", "url": "/v1/completions", "body": {"model": "echo", "prompt": "x", "n": 3}}
LINES

id=$(trtllm-worker batch submit requests.jsonl --id nightly-2026-12-05 --wait)
trtllm-worker batch status "$id" | python3 -c 'import json, sys; print(json.load(sys.stdin)["request_counts"])'
trtllm-worker batch results "$id" -o output.jsonl --errors errors.jsonl
python3 -c '
import json
for line in open("output.jsonl"):
    line = json.loads(line)
    print(line["custom_id"], repr(line["response"]["body"]["choices"][0]["text"]))
for line in open("errors.jsonl"):
    line = json.loads(line)
    print(line["custom_id"], line["error"]["code"])
'
