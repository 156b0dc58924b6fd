"""`python -m bench [SCENARIO ...]`, the same as `python bench/run.py`."""

from bench.cli import main

main()
