"""docs/configuration.md's tables list exactly what the code reads: every plan key (nshard/run/plan.py's
dataclasses), every key of the ds_config's `nshard` section (nshard/comm/config.py's ReducerConfig), every
NSHARD_* variable, and the other tools' variables the package reads; and it names every shipped plan and ds_config.
No launches: the code's sets come from the code itself (its dataclasses, its sources)."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from nshard.comm.config import ReducerConfig
from nshard.run.plan import SECTIONS, ArmSpec

REPO = Path(__file__).resolve().parent.parent
CONFIGURATION = REPO / "docs" / "configuration.md"
ROW_KEY = re.compile(r"^\| ((?:`[^`]+`(?:, )?)+) \|")


def section(text: str, heading: str) -> str:
    """The text under `## heading`, up to the next `## ` heading (### subsections included)."""
    body = text.split(f"\n## {heading}\n", 1)
    assert len(body) == 2, f"docs/configuration.md has no '## {heading}' section"
    return body[1].split("\n## ", 1)[0]


def tables(heading: str) -> list[list[str]]:
    """Each table under `## heading`, in order, as the backticked names in its rows' first column (a row may
    name several: `A`, `B`)."""
    found, current = [], None
    for line in section(CONFIGURATION.read_text(), heading).splitlines():
        if not line.startswith("|"):
            current = None
            continue
        if current is None:
            current = []
            found.append(current)
        match = ROW_KEY.match(line)
        if match:
            current += re.findall(r"`([^`]+)`", match.group(1))
    return found


def documented(heading: str, table: int | None = None) -> list[str]:
    """The names one table lists (`table`), or every table of the section together."""
    found = tables(heading)
    return found[table] if table is not None else [name for names in found for name in names]


def toml_keys(cls) -> set[str]:
    to_key = {name: key for key, name in getattr(cls, "TOML_KEYS", {}).items()}
    return {to_key.get(f.name, f.name) for f in dataclasses.fields(cls)}


def code_plan_keys() -> set[str]:
    keys = {"name"} | {f"{name}.{key}" for name, cls in SECTIONS.items() for key in toml_keys(cls)}
    return keys | {f"study.arms[].{key}" for key in toml_keys(ArmSpec)}


def test_the_plan_tables_list_exactly_the_keys_the_plan_reads():
    rows = documented("The plan")
    assert len(rows) == len(set(rows)), f"a plan key is listed twice: {sorted(k for k in rows if rows.count(k) > 1)}"
    missing, extra = code_plan_keys() - set(rows), set(rows) - code_plan_keys()
    assert not missing and not extra, (f"docs/configuration.md's plan tables lack {sorted(missing)} and list "
                                       f"{sorted(extra)}, which nshard/run/plan.py does not read")


def test_the_nshard_section_table_lists_exactly_the_reducer_config_fields():
    rows = documented("The `nshard` section")
    fields = [f.name for f in dataclasses.fields(ReducerConfig)]
    assert sorted(rows) == sorted(fields), (f"docs/configuration.md's nshard table: lacks "
                                            f"{sorted(set(fields) - set(rows))}, lists {sorted(set(rows) - set(fields))}")


def code_nshard_variables() -> set[str]:
    sources = [p for folder in ("nshard", "analysis", "launch", "tests") for p in (REPO / folder).rglob("*")
               if p.suffix in (".py", ".sh")]
    found = set()
    for path in sources:
        found |= set(re.findall(r"\bNSHARD_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    return found


def test_the_nshard_variable_table_lists_every_nshard_variable_in_the_code():
    rows = set(documented("Environment variables", table=0))
    assert all(name.startswith("NSHARD_") for name in rows), rows
    code = code_nshard_variables()
    assert rows == code, (f"docs/configuration.md's NSHARD_* table lacks {sorted(code - rows)} and lists "
                          f"{sorted(rows - code)}, which no source names")


def package_sources() -> list[Path]:
    return sorted([*(REPO / "nshard").rglob("*.py"), *(REPO / "analysis").rglob("*.py")])


def environment_reads(path: Path) -> set[str]:
    """Names read from the environment with a literal name: environ.get/setdefault("X"), environ["X"], "X" in env."""
    def is_environ(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
            isinstance(node, ast.Name) and node.id in ("env", "environ"))

    def literal(node):
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args
                and node.func.attr in ("get", "setdefault", "pop") and is_environ(node.func.value)):
            names.add(literal(node.args[0]))
        elif isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
            names.add(literal(node.slice))
        elif (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn))
              and is_environ(node.comparators[0])):
            names.add(literal(node.left))
    return {n for n in names if n}


def test_the_other_variable_table_lists_what_the_package_reads_and_nothing_it_does_not_name():
    rows = set(documented("Environment variables", table=1))
    reads = set().union(*(environment_reads(p) for p in package_sources())) - code_nshard_variables()
    source = "\n".join(p.read_text() for p in package_sources())
    assert reads <= rows, f"docs/configuration.md's table of other variables lacks {sorted(reads - rows)}"
    unnamed = sorted(name for name in rows if not re.search(rf"\b{name}\b", source))
    assert not unnamed, f"docs/configuration.md lists {unnamed}, which nshard/ and analysis/ never name"


def test_the_environment_scan_sees_a_read_it_must_see(tmp_path):
    """The AST scan is what keeps the second table honest: it must find each form of read."""
    probe = tmp_path / "probe.py"
    probe.write_text('import os\nenv = os.environ\na = os.environ.get("A_X")\nb = env["B_X"]\n'
                     'c = "C_X" in env\nenv.setdefault("D_X", "1")\nos.environ["E_X"] = "written, not read"\n')
    assert environment_reads(probe) == {"A_X", "B_X", "C_X", "D_X"}


def test_every_shipped_plan_and_ds_config_is_described():
    text = CONFIGURATION.read_text()
    plans = section(text, "Plans")
    configs = section(text, "The ds_config")
    missing = [p.name for p in sorted((REPO / "launch" / "plans").glob("*.toml")) if f"`{p.name}`" not in plans]
    missing += [p.name for p in sorted((REPO / "ds_configs").glob("*.json")) if f"`{p.name}`" not in configs]
    assert not missing, f"docs/configuration.md does not describe {missing}"


def heading_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_the_pages_finds_its_file_and_heading():
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    pages = [p.resolve() for p in pages]
    anchors = {p: {heading_anchor(h) for h in re.findall(r"^#+ (.+)$", p.read_text(), re.M)} for p in pages}
    broken = []
    for page in pages:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path = (page.parent / target).resolve() if target else page
            if path.suffix == ".md" and path.is_file() and path not in anchors:  # a launch/recipe/ record, say
                anchors[path] = {heading_anchor(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), re.M)}
            if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors.get(path, set())):
                broken.append(f"{page.relative_to(REPO)}: ({target}#{anchor})")
    assert not broken, f"links that lead nowhere: {broken}"
