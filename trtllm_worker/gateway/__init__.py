"""The OpenAI-compatible gateway (`trtllm-worker gateway`): OpenAI's HTTP API in front
of the queue. Each request becomes a job published with the client SDK and is answered
from the job's Redis stream, so an answer outlives the worker that started it. It stands
on `client/` alone (never the worker's pipeline or engine) and holds no state another
replica could not rebuild from Redis."""
