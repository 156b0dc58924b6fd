"""trtllm-worker: serve TensorRT-LLM from a RabbitMQ job queue into Redis streams."""

__version__ = "0.1.0"
