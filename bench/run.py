"""trtllm-worker benchmark: real worker processes (echo engine standing in for a GPU),
jobs published through RabbitMQ with publisher confirms, every stream read with XREAD as
a subscriber does. `make bench` runs every scenario; `python bench/run.py --help`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` as a package

from bench.cli import main

if __name__ == "__main__":
    main()
