"""The grants docs/security.md lists are what `trtllm-worker acl` prints for the defaults."""

from __future__ import annotations

from pathlib import Path

from trtllm_worker.config import Settings
from trtllm_worker.connect.grants import as_text

SECURITY_PAGE = Path(__file__).parents[2] / "docs" / "security.md"


def test_the_docs_list_the_grants_as_acl_prints_them() -> None:
    text = SECURITY_PAGE.read_text(encoding="utf-8")
    listed = text.split("```text\n", 1)[1].split("```", 1)[0]
    defaults = Settings(
        _env_file=None, queue="generate", stream_prefix="gen:", amqp_url="amqp://h:5672/"
    )  # whatever WORKER_* the environment holds
    assert listed == as_text(defaults)
