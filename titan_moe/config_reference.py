"""The configuration reference (docs/config.md) and the environment table (docs/environment.md),
generated from the code.

    python -m titan_moe.config_reference > docs/config.md
    python -m titan_moe.config_reference --environment > docs/environment.md
    python -m titan_moe.config_reference --write      # both files, from the repository root
    python -m titan_moe.config_reference --check      # exit 1 when either file is stale

The configuration is torchtitan 0.2.2's `JobConfig` merged with our sections
(`titan_moe.config.job_config_class()`). A key's text is the string literal that follows the
field in its dataclass (torchtitan's convention and ours), read from the source with `ast`;
`ModelArgs` documents its fields with comments instead, which are read the same way. Our keys
are listed in full; torchtitan's with the first sentence of their text. The environment table
is `titan_moe.ops.launch_env.VARIABLES`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import sys
import textwrap
import tokenize
import typing
from pathlib import Path
from typing import Any

DOCS = Path("docs")
CONFIG_MD = DOCS / "config.md"
ENVIRONMENT_MD = DOCS / "environment.md"


# ---------------------------------------------------------------------------------------
# field texts from the source


def _comments_by_line(src: str) -> dict[int, str]:
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def _class_field_docs(cls: type) -> dict[str, str]:
    """name -> text for the fields defined in `cls`'s own body."""
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    tree = ast.parse(src)
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef)).body
    lines = src.splitlines()
    comments = _comments_by_line(src)
    docs: dict[str, str] = {}
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name = node.target.id
        nxt = body[i + 1] if i + 1 < len(body) else None
        if (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[name] = inspect.cleandoc(nxt.value.value)
            continue
        text = comments.get(node.end_lineno)  # a comment at the end of the field's line
        if text is None:  # comment lines right above the field (not a "# --- group ---" line)
            above, line = [], node.lineno - 1
            while line >= 1 and lines[line - 1].strip().startswith("#"):
                c = lines[line - 1].strip().lstrip("#").strip()
                if c.startswith("---"):
                    break
                above.insert(0, c)
                line -= 1
            text = " ".join(above) or None
        if text:
            docs[name] = text
    return docs


def field_docs(cls: type) -> dict[str, str]:
    """name -> text of every documented field of `cls` and its dataclass bases."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            docs.update(_class_field_docs(base))
    return docs


# ---------------------------------------------------------------------------------------
# rendering


def _one_line(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _first_sentence(text: str) -> str:
    text = " ".join(text.split())
    for end in (". ", "; "):
        if end in text:
            return text[: text.index(end) + 1]
    return text


def _type_name(tp: Any) -> str:
    if isinstance(tp, str):
        return tp
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(tp))
    if origin is not None:
        args = typing.get_args(tp)
        if type(None) in args and len(args) == 2:
            return _type_name(next(a for a in args if a is not type(None))) + " or none"
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type_name(a) for a in args)}]"
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        return ""
    return "`" + repr(value).replace("|", "\\|") + "`"


def _leaves(cls: type, prefix: str) -> list[tuple[str, type]]:
    """(dotted section, dataclass) for `cls` and every dataclass nested in it."""
    out = [(prefix, cls)]
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type):
            out += _leaves(f.type, f"{prefix}.{f.name}")
        elif typing.get_origin(f.type) is list and dataclasses.is_dataclass(typing.get_args(f.type)[0]):
            # an array of tables ([[ladder.stages]]): the keys of one entry
            out += _leaves(typing.get_args(f.type)[0], f"{prefix}.{f.name}")
    return out


def _ours_by_section() -> dict[str, type]:
    from titan_moe.config import TitanJobConfig

    out: dict[str, type] = {}
    for f in dataclasses.fields(TitanJobConfig):
        for section, cls in _leaves(f.type, f.name):
            out[section] = cls
    return out


def _torchtitan_by_section() -> dict[str, type]:
    from torchtitan.config import JobConfig

    out: dict[str, type] = {}
    for f in dataclasses.fields(JobConfig):
        if dataclasses.is_dataclass(f.type):
            for section, cls in _leaves(f.type, f.name):
                out[section] = cls
    return out


def _plain_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if not dataclasses.is_dataclass(f.type)]


def _model_section() -> list[str]:
    from titan_moe.flavors import FLAVORS
    from titan_moe.model.args import ModelArgs

    hints = typing.get_type_hints(ModelArgs)
    docs = field_docs(ModelArgs)
    names = list(FLAVORS)
    lines = [
        "### `[model]`",
        "",
        "torchtitan's `name` (`\"titan_moe\"`) and `flavor` pick a preset from `titan_moe/flavors.py`;",
        "every `ModelArgs` field (`titan_moe/model/args.py`) may also be set here and overrides the",
        "preset (unset: the preset's value). The columns show each preset's value.",
        "",
        "| key | type | " + " | ".join(f"`{n}`" for n in names) + " | meaning |",
        "| --- | --- | " + " | ".join("---" for _ in names) + " | --- |",
    ]
    for f in dataclasses.fields(ModelArgs):
        values = " | ".join(f"`{getattr(FLAVORS[n], f.name)!r}`" for n in names)
        lines.append(f"| `{f.name}` | {_type_name(hints[f.name])} | {values} | "
                     f"{_one_line(docs.get(f.name, ''))} |")
    return lines + [""]


def config_markdown() -> str:
    """The text of docs/config.md."""
    from titan_moe.config import job_config_class

    merged = job_config_class()
    ours = _ours_by_section()
    titan = _torchtitan_by_section()
    merged_sections = [s for s, _ in _leaves_of_root(merged)]

    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m titan_moe.config_reference > docs/config.md`; do not edit.",
        "     tests/test_docs.py fails when this file is stale. -->",
        "",
        "A training job is one TOML file (`--job.config_file FILE.toml`) of `[section]` tables.",
        "Every key can also be given on the command line as `--section.key value`, which wins over",
        "the file; booleans as `--section.key` / `--section.no_key`. `python -m titan_moe.train",
        "--help` prints every key with its default. An unknown key or a bad value stops with one",
        "line naming the key and the file (exit code 2).",
        "",
        "The configuration is torchtitan 0.2.2's `JobConfig` with our keys merged into it",
        "(`titan_moe.config.job_config_class()`). Part 1 lists every key this project adds, with",
        "its full description; part 2 lists torchtitan's keys with the first sentence of theirs",
        "(torchtitan's `torchtitan/config/job_config.py` has the rest).",
        "",
        "## Part 1: titan_moe's keys",
        "",
    ]
    lines += _model_section()
    for section in merged_sections:
        if section == "model" or section not in ours:
            continue
        cls = ours[section]
        plain = _plain_fields(cls)
        if not plain:
            continue
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        shared = " (next to torchtitan's keys of this table, part 2)" if section in titan else ""
        lines += [f"### `[{section}]`{shared}", "",
                  "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for f in plain:
            lines.append(f"| `{f.name}` | {_type_name(hints.get(f.name, f.type))} | {_default(f)} | "
                         f"{_one_line(docs.get(f.name, ''))} |")
        lines.append("")

    lines += ["## Part 2: torchtitan 0.2.2's keys", ""]
    for section in merged_sections:
        if section not in titan:
            continue
        cls = titan[section]
        plain = _plain_fields(cls)
        if not plain:
            continue
        ours_here = {f.name for f in _plain_fields(ours[section])} if section in ours else set()
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        lines += [f"### `[{section}]`", "", "| key | type | default | meaning |",
                  "| --- | --- | --- | --- |"]
        for f in plain:
            note = " (our default; part 1)" if f.name in ours_here else ""
            lines.append(f"| `{f.name}` | {_type_name(hints.get(f.name, f.type))} | {_default(f)} | "
                         f"{_one_line(_first_sentence(docs.get(f.name, '')))}{note} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _leaves_of_root(root: type) -> list[tuple[str, type]]:
    out = []
    for f in dataclasses.fields(root):
        if dataclasses.is_dataclass(f.type):
            out += _leaves(f.type, f.name)
    return out


def environment_markdown() -> str:
    """The text of docs/environment.md."""
    from titan_moe.ops.launch_env import VARIABLES

    lines = [
        "# Environment variables",
        "",
        "<!-- Generated by `python -m titan_moe.config_reference --environment > docs/environment.md`;",
        "     do not edit. tests/test_docs.py fails when this file is stale. -->",
        "",
        "Environment variables are for launch tuning and debugging only: kernel tiles, warps,",
        "register caps, debug checks and test hooks. None of them changes which implementation the",
        "model runs or what it computes; those choices are config keys (`[kernels]` and the other",
        "sections of [the configuration reference](config.md)). `titan_moe/ops/launch_env.py` is the",
        "one module that reads them, and this table is its `VARIABLES`.",
        "",
        "| variable | what it tunes |",
        "| --- | --- |",
    ]
    for name in sorted(VARIABLES):
        lines.append(f"| `{name}` | {_one_line(VARIABLES[name])} |")
    return "\n".join(lines) + "\n"


GENERATED = {CONFIG_MD: config_markdown, ENVIRONMENT_MD: environment_markdown}


def stale_files(root: Path = Path(".")) -> list[Path]:
    """The generated files under `root` whose text differs from what the code generates now."""
    out = []
    for rel, make in GENERATED.items():
        path = root / rel
        if not path.exists() or path.read_text() != make():
            out.append(rel)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_moe.config_reference",
                                     description="Print (or write, or check) the generated docs.")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--environment", action="store_true", help="print docs/environment.md instead")
    what.add_argument("--write", action="store_true", help="write docs/config.md and docs/environment.md")
    what.add_argument("--check", action="store_true", help="exit 1 when either file is stale")
    args = parser.parse_args(argv)
    if args.write:
        for rel, make in GENERATED.items():
            rel.parent.mkdir(parents=True, exist_ok=True)
            rel.write_text(make())
            print(f"wrote {rel}")
        return 0
    if args.check:
        stale = stale_files()
        for rel in stale:
            print(f"{rel} is stale: run python -m titan_moe.config_reference --write", file=sys.stderr)
        return 1 if stale else 0
    sys.stdout.write(environment_markdown() if args.environment else config_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
