"""The names README.md and docs/*.md spell in code resolve against the package: every
``rt.`` / ``ringtrain.`` / ``hvd.`` dotted name imports or is an attribute, every keyword
shown in a call of one is a parameter, every flag shown after ``ringrun`` (and in
docs/launch.md's flag table) is in ringrun's parser, and every ``RINGTRAIN_*`` variable
is read by the package. A rename in the code then fails here instead of leaving the docs
pointing at nothing."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from dataclasses import fields
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from ringtrain.launch.cli import build_parser
from ringtrain.settings import Settings, env_name

ROOT = Path(__file__).resolve().parents[3]
SRC = ROOT / "src" / "ringtrain"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# A dotted name in code; "/a/b" after it spells siblings (`rt.checkpoint.save/load/latest`).
NAME = re.compile(r"(?<![\w./-])(rt|rtk|hvd|ringtrain)((?:\.[A-Za-z_]\w*)+)((?:/[A-Za-z_]\w*)*)")
CALL = re.compile(r"(?<![\w./-])(rt|rtk|hvd|ringtrain)((?:\.[A-Za-z_]\w*)+)\(")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
VARIABLE = re.compile(r"RINGTRAIN_[A-Z0-9_]*[A-Z0-9]")

# Names the docs spell on purpose although nothing defines them.
NOT_API: set[str] = set()
# docs/launch.md shows the warning a misspelt variable gets; it must stay unread.
NOT_READ = {"RINGTRAIN_STALL_TIMOUT"}
# Importing Keras takes 10-20 s on a 2-core machine, too slow for a unit test: names under
# ringtrain.keras are looked up in its sources (top-level defs, imports and assignments,
# submodules).
STATIC = "ringtrain.keras"
# A **kwargs that only refuses: rt.data.Loader(**dataloader_only) names the fix for a
# DataLoader argument and raises for every name, so its explicit parameters are all it takes.
REFUSING = {"dataloader_only"}


def code_of(markdown: str) -> list[str]:
    """The fenced blocks and inline code spans of a markdown text."""
    blocks = FENCE.findall(markdown)
    prose = FENCE.sub("", markdown)
    return blocks + SPAN.findall(prose)


def prefixes(doc: Path) -> dict[str, str]:
    # docs/keras.md's hvd is Horovod's Keras module (`import ringtrain.keras as hvd`).
    hvd = "ringtrain.keras" if doc.name == "keras.md" else "ringtrain.horovod"
    return {"rt": "ringtrain", "ringtrain": "ringtrain", "rtk": "ringtrain.keras", "hvd": hvd}


def dotted_names(code: str, alias: dict[str, str]) -> set[str]:
    """Full dotted names in ``code``, aliases spelled out and siblings expanded."""
    out = set()
    for m in NAME.finditer(code):
        name = alias[m.group(1)] + m.group(2)
        out.add(name)
        parent = name.rpartition(".")[0]
        out.update(f"{parent}.{sibling}" for sibling in m.group(3).split("/")[1:])
    return out


def _static_names(module: str) -> set[str] | None:
    """Top-level names of a module's source, with a package's submodules (None: no file)."""
    base = SRC.parent.joinpath(*module.split("."))
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    if not path.is_file():
        return None
    names = {p.stem for p in base.iterdir()} if base.is_dir() else set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _resolves_statically(name: str) -> bool:
    module, _, rest = name.partition(".")
    for part in rest.split("."):
        known = _static_names(module)
        if known is None:
            return True  # an attribute of a class or object: not read from source
        if part not in known:
            return False
        module = f"{module}.{part}"
    return True


@cache
def resolve(name: str) -> Any:
    """The object a dotted name stands for; LookupError naming the first missing part."""
    if name == STATIC or name.startswith(STATIC + "."):
        if not _resolves_statically(name):
            raise LookupError(name)
        return None
    parts = name.split(".")
    obj: Any = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 2):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise  # the module exists but lacks a dependency: not the docs' fault
            raise LookupError(module) from None
    return obj


def unresolved(names: set[str]) -> list[str]:
    missing = []
    for name in sorted(names - NOT_API):
        try:
            resolve(name)
        except LookupError as e:
            missing.append(f"{name} ({e.args[0]} does not exist)")
    return missing


def keywords(code: str, start: int) -> list[str]:
    """The ``kw=`` arguments of the call whose '(' is at ``start``."""
    depth, out, piece = 0, [], ""
    for ch in code[start:]:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth == 0:
            break
        if depth == 1 and ch == ",":
            out.append(piece)
            piece = ""
        elif depth >= 1:
            piece += ch
    out.append(piece)
    return [m.group(1) for p in out if (m := re.match(r"\s*\(?\s*(\w+)\s*=(?!=)", p))]


def bad_keywords(code: str, alias: dict[str, str]) -> list[str]:
    out = []
    for m in CALL.finditer(code):
        name = alias[m.group(1)] + m.group(2)
        try:
            obj = resolve(name)
        except LookupError:
            continue  # reported by the name test
        if obj is None or not callable(obj):
            continue
        # a class's own parameters are its __init__'s (DistributedOptimizer's __new__ takes *args)
        target = obj.__init__ if inspect.isclass(obj) else obj
        try:
            params = inspect.signature(target).parameters
        except (TypeError, ValueError):
            continue
        if any(p.kind is p.VAR_KEYWORD and p.name not in REFUSING for p in params.values()):
            # **options: only the named ones can be checked (DistributedOptimizer's strategy
            # options pass through), so a spelling the signature lacks is not reported
            continue
        out += [f"{name}(..., {kw}=)" for kw in keywords(code, m.end() - 1) if kw not in params]
    return out


@cache
def ringrun_options() -> dict[str, Any]:
    """ringrun's option strings -> their argparse nargs."""
    return {s: a.nargs for a in build_parser()._actions for s in a.option_strings}


def ringrun_flags(code: str) -> list[str]:
    """The options of every ``ringrun ...`` command line in ``code``, up to the command;
    ``--min-np/--max-np`` spells two."""
    values = ringrun_options()
    out = []
    for m in re.finditer(r"(?<![\w/.-])ringrun((?:[ \t]+[^\s#]+)*)", code):
        tokens = m.group(1).split()
        i = 0
        while i < len(tokens) and tokens[i].startswith("-") and tokens[i] != "--":
            flag, inline, _ = tokens[i].partition("=")
            out += flag.split("/")
            nargs = values.get(flag, 0)  # an unknown flag: reported, assumed to take no value
            count = 1 if nargs is None else nargs if isinstance(nargs, int) else 1
            i += 1 + (0 if inline else count)
    return out


def unknown_flags(flags: set[str]) -> list[str]:
    return sorted(flags - set(ringrun_options()))


def launch_table_flags() -> list[str]:
    """First-column flags of docs/launch.md's "## Flags" table."""
    text = (ROOT / "docs" / "launch.md").read_text()
    section = text.split("## Flags", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return [flag for cell in rows for span in SPAN.findall(cell)
            for flag in re.findall(r"(?<![\w-])--?[a-z][-a-z]*", span)]


def read_variables() -> set[str]:
    # settings variables are derived from the field names (settings.env_name)
    names = {env_name(f.name) for f in fields(Settings)}
    for path in SRC.rglob("*.py"):
        names.update(VARIABLE.findall(path.read_text()))
    return names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_dotted_names_in_the_docs_resolve(doc: Path) -> None:
    alias = prefixes(doc)
    names = set().union(*(dotted_names(code, alias) for code in code_of(doc.read_text())))
    assert unresolved(names) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_keywords_in_the_docs_calls_are_parameters(doc: Path) -> None:
    alias = prefixes(doc)
    assert [bad for code in code_of(doc.read_text()) for bad in bad_keywords(code, alias)] == []


def test_ringrun_flags_in_the_docs_exist() -> None:
    spelled = {flag for doc in DOCS for code in code_of(doc.read_text()) for flag in ringrun_flags(code)}
    table = set(launch_table_flags())
    assert len(spelled) > 5 and len(table) > 10  # the extractors still find the flags
    assert unknown_flags(spelled | table) == []


def test_variables_in_the_docs_are_read() -> None:
    spelled = {v for doc in DOCS for v in VARIABLE.findall(doc.read_text())}
    known = read_variables()
    assert sorted(spelled - known - NOT_READ) == []
    assert NOT_READ.isdisjoint(known)


# The checks themselves: a name, keyword or flag the code lacks is reported.

def test_a_bogus_name_is_reported() -> None:
    names = dotted_names("x = rt.data.Loader(ds); rt.checkpoint.save/nosuch; `hvd.no_such_call()`",
                        prefixes(Path("migrate.md")))
    assert unresolved(names) == [
        "ringtrain.checkpoint.nosuch (ringtrain.checkpoint.nosuch does not exist)",
        "ringtrain.horovod.no_such_call (ringtrain.horovod.no_such_call does not exist)",
    ]


def test_a_bogus_keras_name_is_reported_without_importing_keras() -> None:
    alias = prefixes(Path("keras.md"))
    names = dotted_names("rtk.DistributedOptimizer hvd.callbacks rtk.NoSuchCallback", alias)
    assert unresolved(names) == ["ringtrain.keras.NoSuchCallback (ringtrain.keras.NoSuchCallback does not exist)"]


def test_a_bogus_keyword_is_reported() -> None:
    code = "rt.data.Loader(ds, batch_size=64, seeds=0)\nrt.scale_lr(0.1, size=2)\nrt.LocalSGD(m, o, sync_every=4)"
    assert bad_keywords(code, prefixes(Path("data.md"))) == ["ringtrain.data.Loader(..., seeds=)",
                                                             "ringtrain.scale_lr(..., size=)"]


def test_a_bogus_ringrun_flag_is_reported() -> None:
    flags = ringrun_flags("ringrun -np 2 --hostfile h.txt --min-np/--max-np --no-such-flag python t.py --lr 1")
    assert flags == ["-np", "--hostfile", "--min-np", "--max-np", "--no-such-flag"]
    assert unknown_flags(set(flags)) == ["--no-such-flag"]

