"""Write the tables of docs/settings.md from the `Settings` class (`make docs` runs it).

Each table sits between `<!-- settings:GROUP -->` and `<!-- /settings:GROUP -->` in the
page; everything outside the markers is prose, edited by hand. A row is one field of
`trtllm_worker.config.Settings`: its `WORKER_*` variable, its default and its
`description`. `--check` changes nothing and exits 1 when the page is out of date
(tests/docs runs the same comparison).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from pydantic.fields import FieldInfo

from trtllm_worker.config import ENV_PREFIX, Settings

PAGE = Path(__file__).parent / "settings.md"

ENGINE_FIRST_FIELD = "model"
"""The TensorRT-LLM settings are the fields from this one on (config.py's own order)."""

MARKER = re.compile(r"(<!-- settings:(\w+) -->\n)(.*?)(<!-- /settings:\2 -->)", re.DOTALL)


def groups() -> dict[str, list[tuple[str, FieldInfo]]]:
    """The fields of each table, in the order config.py declares them."""
    fields = list(Settings.model_fields.items())
    split = [name for name, _ in fields].index(ENGINE_FIRST_FIELD)
    return {"worker": fields[:split], "engine": fields[split:]}


def default_text(field: FieldInfo) -> str:
    value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def table(fields: list[tuple[str, FieldInfo]]) -> str:
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for name, field in fields:
        if not field.description:
            raise SystemExit(
                f"Settings.{name} has no description (config.py: Field(description=...))"
            )
        meaning = field.description.replace("|", "\\|")
        rows.append(f"| `{ENV_PREFIX}{name.upper()}` | {default_text(field)} | {meaning} |")
    return "\n".join(rows) + "\n"


def render(page: str) -> str:
    """The page with every marked table written anew from `Settings`."""
    tables = {group: table(fields) for group, fields in groups().items()}
    seen: set[str] = set()

    def fill(match: re.Match[str]) -> str:
        group = match.group(2)
        if group not in tables:
            raise SystemExit(f"{PAGE}: no settings group {group!r} (known: {', '.join(tables)})")
        seen.add(group)
        return f"{match.group(1)}\n{tables[group]}\n{match.group(4)}"

    text = MARKER.sub(fill, page)
    if missing := set(tables) - seen:
        raise SystemExit(f"{PAGE}: no markers for {', '.join(sorted(missing))}")
    return text


def main(argv: list[str]) -> int:
    old = PAGE.read_text(encoding="utf-8")
    new = render(old)
    if "--check" in argv:
        if new != old:
            print(f"{PAGE} is out of date: run `make docs`", file=sys.stderr)
            return 1
        return 0
    if new != old:
        PAGE.write_text(new, encoding="utf-8")
        print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
