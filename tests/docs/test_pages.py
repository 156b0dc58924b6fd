"""The pages agree with the code: the settings tables are what docs/gen_settings.py writes
from `Settings`, and the README shows the example files as they are."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from trtllm_worker.config import ENV_PREFIX, Settings

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_settings", DOCS / "gen_settings.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_settings_page_is_generated_from_the_settings_class() -> None:
    page = (DOCS / "settings.md").read_text(encoding="utf-8")
    assert load_generator().render(page) == page, "docs/settings.md is stale: run `make docs`"


def test_every_setting_has_a_description_and_a_row() -> None:
    page = (DOCS / "settings.md").read_text(encoding="utf-8")
    for name, field in Settings.model_fields.items():
        assert field.description, f"Settings.{name} has no description"
        assert f"| `{ENV_PREFIX}{name.upper()}` |" in page


def test_a_stale_settings_table_is_rewritten() -> None:
    generator = load_generator()
    page = (DOCS / "settings.md").read_text(encoding="utf-8")
    stale = page.replace("| `WORKER_QUEUE` | `generate` |", "| `WORKER_QUEUE` | `jobs` |")
    assert stale != page
    assert generator.render(stale) == page


@pytest.mark.parametrize("example", ["producer.py", "subscriber.py", "cli.sh"])
def test_the_readme_shows_the_tested_example(example: str) -> None:
    code = (DOCS / "examples" / example).read_text(encoding="utf-8").rstrip("\n")
    assert code in (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_readme_stays_a_front_door() -> None:
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 300
