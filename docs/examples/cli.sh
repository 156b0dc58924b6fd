#!/usr/bin/env bash
# The CLI reads the worker's WORKER_* settings (URLs, queue, stream prefix).
set -euo pipefail

id=$(trtllm-worker submit "Once upon a time" -p max_new_tokens=16 -p stop='["\n\n"]')
trtllm-worker tail "$id"                     # the stream, to its end
trtllm-worker submit "Hello" -p max_new_tokens=8 --follow   # submit and follow
trtllm-worker cancel "$id"                   # a finished job: nothing changes
