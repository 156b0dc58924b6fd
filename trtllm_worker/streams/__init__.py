"""Redis: every write of the worker, fenced."""
