"""tests/node's packages: `npm ci` from the committed package-lock.json, run by the first
test that needs them (a fresh clone needs nothing else than node and npm), again only
when the lockfile changed. Several pytest processes at once take turns on a lock file."""

from __future__ import annotations

import fcntl
import subprocess
from pathlib import Path

NODE_DIR = Path(__file__).parent / "node"
LOCKFILE = NODE_DIR / "package-lock.json"
INSTALLED = NODE_DIR / "node_modules" / ".package-lock.json"
"""What npm writes once an install completes (the tree as installed)."""


def up_to_date() -> bool:
    return INSTALLED.exists() and INSTALLED.stat().st_mtime >= LOCKFILE.stat().st_mtime


def node_modules() -> Path:
    """tests/node/node_modules, installed from the lockfile when it is not yet."""
    with (NODE_DIR / ".npm-ci.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not up_to_date():
            done = subprocess.run(
                ["npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund"],
                cwd=NODE_DIR, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(f"npm ci in {NODE_DIR} failed:\n{done.stdout}{done.stderr}")
    return NODE_DIR / "node_modules"
