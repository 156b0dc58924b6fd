"""Redis: the one place a client is built, and every write of the worker, fenced."""
