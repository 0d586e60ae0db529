"""The README and docs/ stay true to the code: a user copies their commands as written, follows
their links, and trusts their lists (dependencies, the CI time), so each of those is checked here
instead of being found stale by the next reader. Nothing long runs: a command is parsed by the
real argparse parser or checked against the file it runs, never executed."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import re
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from mmworker.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
#: Pages whose commands are meant to be copied: the README, docs/ and how to run the benchmarks.
COMMAND_PAGES = [README, *DOCS, ROOT / "bench" / "README.md"]
#: Pages whose links are followed (bench/HISTORY.md too: it links back to the current pages).
LINK_PAGES = [*COMMAND_PAGES, ROOT / "bench" / "HISTORY.md", ROOT / "tests" / "README.md"]

FENCE = re.compile(r"^```(\w*)\s*$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`([^`]+)`")
#: Top-level folders of the repository: a token that starts with one is a path that must exist.
REPO_DIRS = (
    "bench/", "deploy/", "docs/", "mmworker/", "preprocess/", "schemas/", "scripts/", "tests/",
)  # fmt: skip
#: Where a command writes (gitignored, made by the command): not expected in a fresh clone.
OUTPUT_OPTIONS = {"--out", "--json", "--work-dir"}
PYTHONS = {".venv/bin/python", "python", "python3"}
MMWORKERS = {"mmworker", ".venv/bin/mmworker"}


def fenced_blocks(path: Path) -> Iterator[tuple[str, str]]:
    """(language, text) of every fenced code block of a Markdown page."""
    lang: str | None = None
    lines: list[str] = []
    for line in path.read_text().splitlines():
        match = FENCE.match(line)
        if lang is None and match:
            lang, lines = match.group(1), []
        elif lang is not None and line.strip() == "```":
            yield lang, "\n".join(lines)
            lang = None
        elif lang is not None:
            lines.append(line)


def prose(path: Path) -> str:
    """The page without its fenced code blocks (a link or a command span there is not prose)."""
    out, inside = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line) or (inside and line.strip() == "```"):
            inside = not inside
            continue
        if not inside:
            out.append(line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {
        slug(line.lstrip("#")) for line in prose(path).splitlines() if re.match(r"^#{1,6} ", line)
    }


def shell_commands(text: str) -> Iterator[str]:
    """Each command of a shell block: continuations joined, heredoc bodies and comments left out,
    `&&`, `;` and `|` split."""
    joined = re.sub(r"\\\n", " ", text)
    heredoc_end: str | None = None
    for line in joined.splitlines():
        if heredoc_end is not None:
            if line.strip() == heredoc_end:
                heredoc_end = None
            continue
        here = re.search(r"<<-?\s*'?(\w+)'?", line)
        if here:
            heredoc_end = here.group(1)
        command_line = line[: here.start()] if here else line
        yield from (part.strip() for part in _split_unquoted(command_line) if part.strip())


def _split_unquoted(line: str) -> list[str]:
    """`a && b; c | d # note` -> ["a ", " b", " c ", " d "]: separators and comments count only
    outside quotes (`--set 'x;y'` stays one argument)."""
    parts, current, quote = [], "", ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            break
        elif ch in ";|&":
            parts.append(current)
            current = ""
            continue
        current += ch
    return [*parts, current]


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("mmworker's parser has no subcommands")


SUBCOMMANDS = _subcommands()


def _bench_sources() -> str:
    return "\n".join(p.read_text() for p in sorted((ROOT / "bench").rglob("*.py")))


def _check_paths(tokens: list[str], problems: list[str], where: str) -> None:
    previous = ""
    for token in tokens:
        path = token.rstrip(",.:;)")
        if (
            path.startswith(REPO_DIRS)
            and previous not in OUTPUT_OPTIONS
            and not path.startswith("bench/out/")
            and not any(ch in path for ch in "*?{}$")
            and not (ROOT / path).exists()
        ):
            problems.append(f"{where}: no such file in the repository: {path}")
        previous = token


def check_command(command: str, where: str, *, full_parse: bool) -> list[str]:
    """What is wrong with one command as the page writes it (an empty list: nothing)."""
    problems: list[str] = []
    try:
        tokens = shlex.split(command, comments=True)
    except ValueError as exc:
        return [f"{where}: {command!r} is not valid shell: {exc}"]
    while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):
        tokens = tokens[1:]  # FOO=bar cmd, or an assignment alone
    if not tokens:
        return problems
    _check_paths(tokens, problems, where)
    head, args = tokens[0], tokens[1:]
    if head in PYTHONS and args[:2] == ["-m", "mmworker"]:
        head, args = "mmworker", args[2:]
    if head in MMWORKERS:
        problems += _check_mmworker(args, where, full_parse=full_parse)
    elif head == "make":
        targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
        problems += [f"{where}: no make target {t!r}" for t in args if t not in targets]
    elif head in PYTHONS and args[:1] == ["-m"]:
        if importlib.util.find_spec(args[1]) is None:
            problems.append(f"{where}: no module {args[1]}")
    elif head in PYTHONS or head in {"bash", "sh"} or head.endswith((".py", ".sh")):
        script = head if head.endswith((".py", ".sh")) else (args[0] if args else "")
        if not (ROOT / script).is_file():
            problems.append(f"{where}: no script {script!r}")
        elif script.endswith(".py"):
            bench = script.startswith("bench/")
            source = _bench_sources() if bench else (ROOT / script).read_text()
            for flag in (t.split("=")[0] for t in args if t.startswith("--")):
                # argparse.BooleanOptionalAction makes --no-X out of "--X".
                if f'"{flag}"' not in source and f'"--{flag[5:]}"' not in source:
                    problems.append(f"{where}: {script} has no option {flag}")
    return problems


def _check_mmworker(args: list[str], where: str, *, full_parse: bool) -> list[str]:
    if not args or args[0].startswith("-"):
        return (
            []
            if not args or args[0] in {"--version", "--help", "--debug"}
            else [f"{where}: mmworker has no option {args[0]}"]
        )
    name = args[0]
    if not re.fullmatch(r"[a-z][a-z-]*", name):
        # `mmworker COMMAND --help` (a placeholder) or `mmworker tail: no topic ...` (a message)
        return []
    if name not in SUBCOMMANDS:
        return [f"{where}: mmworker has no command {name!r}"]
    if full_parse:
        try:
            build_parser().parse_args(args)
        except SystemExit as exc:
            if exc.code not in (0, None):
                return [f"{where}: `mmworker {shlex.join(args)}` does not parse (exit {exc.code})"]
        return []
    known = SUBCOMMANDS[name]._option_string_actions
    return [
        f"{where}: `mmworker {name}` has no option {flag}"
        for flag in (a.split("=")[0] for a in args[1:] if a.startswith("-") and a != "-")
        if flag not in known and flag != "--debug"
    ]


def test_readme_is_short() -> None:
    """The README is the way in; the detail lives in docs/ (issue 36: at most ~500 lines)."""
    assert len(README.read_text().splitlines()) <= 500


@pytest.mark.parametrize("page", LINK_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(INLINE_CODE.sub("", prose(page))):
        if re.match(r"^[a-z]+:", target):
            continue  # https:, mailto:
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.name}")
    assert broken == []


@pytest.mark.parametrize("page", COMMAND_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_shell_blocks_run_as_written(page: Path) -> None:
    """Every command of a shell block names a real command, target, script, option and file;
    `mmworker ...` lines are parsed by the CLI's own argparse parser, arguments and all."""
    problems = []
    for lang, text in fenced_blocks(page):
        if lang in {"bash", "sh", "shell", "console"}:
            for command in shell_commands(text):
                problems += check_command(command, page.name, full_parse=True)
    assert problems == []


@pytest.mark.parametrize("page", COMMAND_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_inline_commands_name_real_options(page: Path) -> None:
    """Commands quoted in the text (`mmworker replay --since 2h`, `bench/soak.py --jobs 20000`):
    the command, its options and the files it names exist. Not parsed in full: the text quotes
    fragments (`mmworker backfill` as a name) as well as whole commands."""
    problems = []
    for span in INLINE_CODE.findall(prose(page)):
        for piece in re.split(r"\\?\|(?!\|)|&&|;", span):
            command = piece.strip()
            first = command.split(" ", 1)[0]
            if " " in command and (
                first in MMWORKERS | PYTHONS | {"make"} or first.endswith((".py", ".sh"))
            ):
                problems += check_command(command, page.name, full_parse=False)
    assert problems == []


def test_code_examples_parse() -> None:
    """Python, TOML and JSON examples are valid as written (a user pastes them)."""
    for page in COMMAND_PAGES:
        for lang, text in fenced_blocks(page):
            if lang == "python":
                ast.parse(text, filename=page.name)
            elif lang == "toml":
                tomllib.loads(text)
            elif lang == "json":
                json.loads(text)


def test_every_dependency_is_explained() -> None:
    """Each package pyproject.toml installs has its row in the README's "why" table."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        wanted += extra
    section = README.read_text().split("## Dependencies and why", 1)[1].split("\n## ", 1)[0]
    named = {re.split(r"[\[=<>~!]", name)[0].lower() for name in re.findall(r"`([^`]+)`", section)}
    missing = [req for req in wanted if re.split(r"[\[=<>~! ;]", req)[0].lower() not in named]
    assert missing == []


def test_ci_time_is_stated_once() -> None:
    """Two CI figures that disagree were a finding of issue 36: one paragraph says it."""
    paragraphs = [
        (page.name, para)
        for page in [README, *DOCS]
        for para in prose(page).split("\n\n")
        if re.search(r"\bCI\b|\.ci/run", para) and re.search(r"\d+ min\b", para)
    ]
    assert len(paragraphs) == 1, paragraphs


def test_configuration_reference_lives_in_docs_only() -> None:
    """One generated copy (docs/configuration.md, kept current by test_config.py): a second one
    in the README would go stale unnoticed."""
    header = "| setting | environment variable | default | description |"
    holders = [p.name for p in [README, *DOCS] if header in p.read_text()]
    assert holders == ["configuration.md"]
