"""`python -m trtllm_worker`: the same as the `trtllm-worker` command."""

import sys

from trtllm_worker.app.cli import main

if __name__ == "__main__":
    sys.exit(main())
