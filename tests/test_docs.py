"""The user docs stay true to the code: generated pages are current, README stays short, and
what the docs name (configs, modules, scripts, links, kernel keys, environment variables) exists.

Regenerate the generated pages with `python -m titan_moe.config_reference --write`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

from titan_moe import config_reference

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# Pages that describe the code as it is now (docs/LOG.md is history and may name what is gone).
CURRENT_PAGES = [README, ROOT / "BENCHMARKS.md"] + sorted(
    p for p in (ROOT / "docs").glob("*.md") if p.name != "LOG.md"
)


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


@pytest.mark.parametrize("rel", sorted(config_reference.GENERATED), ids=str)
def test_generated_page_is_current(rel):
    path = ROOT / rel
    assert path.exists(), f"{rel} is missing: run python -m titan_moe.config_reference --write"
    assert _text(path) == config_reference.GENERATED[rel](), (
        f"{rel} is stale: run python -m titan_moe.config_reference --write")


def test_config_reference_lists_our_keys_with_their_text():
    text = config_reference.config_markdown()
    # A field documented by a string literal in our config classes and one documented by a
    # comment in ModelArgs both reach the page.
    assert "Fraction of the built-in corpus's documents held out" in text
    assert "| `kda_head_dim` |" in text and "dk = dv" in text


def test_field_docs_reads_literals_and_comments():
    @dataclasses.dataclass
    class Example:
        a: int = 1
        """Text of a."""
        # text of b,
        # over two lines
        b: int = 2
        c: int = 3  # text of c
        d: int = 4

    docs = config_reference.field_docs(Example)
    assert docs == {"a": "Text of a.", "b": "text of b, over two lines", "c": "text of c"}


def test_readme_is_short():
    n = len(_text(README).splitlines())
    assert n < 300, f"README.md has {n} lines; keep it a short guide (details go to docs/)"


@pytest.mark.parametrize("page", CURRENT_PAGES, ids=lambda p: p.name)
def test_named_configs_exist(page):
    missing = {c for c in re.findall(r"configs/[\w.-]+\.toml", _text(page)) if not (ROOT / c).exists()}
    assert not missing, f"{page.name} names configs that do not exist: {sorted(missing)}"


@pytest.mark.parametrize("page", CURRENT_PAGES, ids=lambda p: p.name)
def test_named_scripts_and_modules_exist(page):
    text = _text(page)
    scripts = {s for s in re.findall(r"\b((?:profiling|scripts)/[\w./-]+\.(?:py|sh))", text)}
    missing = sorted(s for s in scripts if not (ROOT / s).exists())
    modules = set(re.findall(r"python -m (titan_moe(?:\.\w+)*)", text))
    missing += sorted(m for m in modules if importlib.util.find_spec(m) is None)
    assert not missing, f"{page.name} names scripts or modules that do not exist: {missing}"


@pytest.mark.parametrize("page", CURRENT_PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", _text(page)):
        if re.match(r"[a-z]+://", target):
            continue
        if not (page.parent / target).exists():
            missing.append(target)
    assert not missing, f"{page.name} links to missing files: {missing}"


@pytest.mark.parametrize("page", CURRENT_PAGES, ids=lambda p: p.name)
def test_named_environment_variables_are_listed(page):
    """Launch variables must be in launch_env's table; a test's own opt-in switch may be named too."""
    from titan_moe.ops.launch_env import VARIABLES

    test_switches = {n for t in (ROOT / "tests").glob("*.py") for n in re.findall(r"TITAN_MOE_TEST_\w+", _text(t))}
    named = set(re.findall(r"\bTITAN_MOE_[A-Z0-9_]+", _text(page)))
    unlisted = sorted(named - set(VARIABLES) - test_switches)
    assert not unlisted, (f"{page.name} names environment variables that titan_moe.ops.launch_env "
                          f"does not list: {unlisted}")


@pytest.mark.parametrize("page", CURRENT_PAGES, ids=lambda p: p.name)
def test_named_kernel_keys_exist(page):
    from titan_moe.ops.choices import KernelChoices

    fields = {f.name for f in dataclasses.fields(KernelChoices)}
    named = set(re.findall(r"(?<![\w/])kernels\.(\w+)\b(?!\.)", _text(page))) - {"md"}
    unknown = sorted(named - fields)
    assert not unknown, f"{page.name} names [kernels] keys that KernelChoices lacks: {unknown}"
