"""The layout holds: docs/layout.md's table matches the tree, only the seam imports DeepSpeed, only the patches
module reaches into DeepSpeed's internals, imports have no circle, and the guard checks what it lists."""

from __future__ import annotations

import ast
import re
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOURCES = sorted([*(REPO / "nshard").rglob("*.py"), *(REPO / "analysis").rglob("*.py"), *(REPO / "launch").glob("*.py")])
SEAM = REPO / "nshard" / "seam"
PATCHES = SEAM / "patches.py"
NOT_LISTED = ("__init__.py", "__main__.py")


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


LAYOUT = REPO / "docs" / "layout.md"


def layout_rows() -> dict[str, str]:
    """path -> what, from docs/layout.md's table (the page is the layout: every `| `path` | what |` row on it)."""
    rows = {}
    for line in LAYOUT.read_text().splitlines():
        match = re.match(r"^\| `([^`]+)` \| (.*) \|$", line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


def imports(path: Path) -> list[str]:
    """Every module name an import statement in `path` names (lazy ones inside functions included)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def test_the_layout_table_matches_the_tree():
    rows = layout_rows()
    assert rows, "docs/layout.md has no layout table"
    for path in rows:
        assert (REPO / path).exists(), f"docs/layout.md row {path} does not exist in the tree"
    nshard = REPO / "nshard"
    wings = sorted(f"nshard/{p.name}/" for p in nshard.iterdir() if (p / "__init__.py").is_file())
    top = sorted(f"nshard/{p.name}" for p in nshard.glob("*.py") if p.name not in NOT_LISTED)
    missing = [p for p in wings + top + ["analysis/", "launch/"] if p not in rows]
    assert not missing, f"docs/layout.md's table lacks rows for {missing}"
    for folder in [w for w in rows if w.endswith("/") and w != "tests/"]:
        named = set(re.findall(r"`([\w.]+\.(?:py|sh))`", rows[folder]))
        present = {p.name for p in (REPO / folder).iterdir() if p.suffix in (".py", ".sh") and p.name not in NOT_LISTED}
        assert named == present, (f"docs/layout.md row {folder}: names {sorted(named - present)} that are not "
                                  f"there and lacks {sorted(present - named)}")


def test_only_the_seam_imports_deepspeed():
    outside = {rel(p): [n for n in imports(p) if n == "deepspeed" or n.startswith("deepspeed.")]
               for p in SOURCES if SEAM not in p.parents}
    outside = {path: names for path, names in outside.items() if names}
    assert not outside, f"DeepSpeed imported outside nshard/seam/: {outside}"


def test_comm_imports_no_deepspeed_and_analysis_no_trainer():
    for path in (REPO / "nshard" / "comm").rglob("*.py"):
        assert not [n for n in imports(path) if n.startswith("deepspeed") or n.startswith("nshard.seam")], rel(path)
    # analysis reads files; of nshard it takes only the commitment record's checks, the command-line convention and
    # the durable file writes (standard library alone)
    allowed = ("nshard.analysis", "nshard.evidence.commit", "nshard.cli", "nshard.files")
    for path in (REPO / "analysis").rglob("*.py"):
        bad = [n for n in imports(path) if n.startswith("torch") or (n.startswith("nshard.")
                                                                    and not n.startswith(allowed))]
        assert not bad, (rel(path), bad)


def _engine_expression(node) -> bool:
    """`engine`, `<anything>.engine`."""
    return (isinstance(node, ast.Name) and node.id == "engine") or (isinstance(node, ast.Attribute)
                                                                     and node.attr == "engine")


def _optimizer_expression(node) -> bool:
    """`<engine>.optimizer` or `self.optimizer` (the engine's optimizer, as the seam's writer keeps it)."""
    return isinstance(node, ast.Attribute) and node.attr == "optimizer" and (
        _engine_expression(node.value) or (isinstance(node.value, ast.Name) and node.value.id == "self"))


def engine_attributes(path: Path) -> set[str]:
    """Attributes read or written on the engine and on its optimizer in `path`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and (_engine_expression(node.value) or _optimizer_expression(node.value)):
            found.add(node.attr)
    return found


def test_only_the_patches_module_reaches_into_deepspeed_internals():
    from nshard.seam.patches import LISTED_ATTRS

    runtime = {rel(p): [n for n in imports(p) if n.startswith("deepspeed.runtime") or n == "deepspeed.runtime"]
               for p in SOURCES if p != PATCHES}
    runtime = {path: names for path, names in runtime.items() if names}
    assert not runtime, f"deepspeed.runtime imported outside nshard/seam/patches.py: {runtime}"
    unlisted = {rel(p): sorted(engine_attributes(p) - LISTED_ATTRS) for p in SOURCES}
    unlisted = {path: attrs for path, attrs in unlisted.items() if attrs}
    assert not unlisted, f"engine or optimizer attributes that nshard/seam/patches.py does not list: {unlisted}"


def test_the_check_itself_catches_a_private_reach(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f(engine):\n    engine.optimizer.bit16_groups.clear()\n    return engine.module\n")
    assert engine_attributes(probe) == {"optimizer", "bit16_groups", "module"}


def test_no_import_circle():
    modules = {}
    for path in SOURCES:
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[0] == "analysis":
            parts = ["nshard", *parts]
        modules[".".join(p for p in parts if p != "__init__")] = path
    graph = {}
    for name, path in modules.items():
        edges = set()
        for imported in imports(path):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                edges.add(imported)
        graph[name] = edges
    state: dict[str, int] = {}

    def visit(name, trail):
        state[name] = 1
        for nxt in sorted(graph[name]):
            assert state.get(nxt) != 1, f"import circle: {' -> '.join(trail + [name, nxt])}"
            if nxt not in state:
                visit(nxt, trail + [name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


# ---------------------------------------------------------------- the guard, at run time


def _complete_engine(stage: int):
    """Stand-ins with every attribute the patches module lists for an engine at `stage`."""
    from nshard.seam import patches

    optimizer = types.SimpleNamespace(**{a: None for a in patches.OPTIMIZER_API + patches.PRIVATE_ZERO_ATTRS
                                         + patches.PRIVATE_ZERO_PARTITION_ATTRS})
    engine = types.SimpleNamespace(**{a: None for a in patches.ENGINE_API + patches.PRIVATE_ENGINE_ATTRS})
    engine.optimizer, engine.zero_optimization_stage = optimizer, lambda: stage
    return engine


def test_the_guard_passes_deepspeed_as_installed():
    from nshard.seam import patches

    patches.guard(_complete_engine(2))


@pytest.mark.parametrize("where, attr", [
    *(("engine", a) for a in ("enable_backward_allreduce", "zero_grad", "module", "backward")),
    *(("optimizer", a) for a in ("gradient_reduction_w_predivide", "allreduce_bucket", "flatten",
                                  "params_in_partition", "averaged_gradients", "_build_compact_grad_partition_buffer",
                                  "param_groups")),
])
def test_the_guard_names_each_missing_attribute(where, attr):
    from nshard.seam import patches

    engine = _complete_engine(2)
    delattr(engine if where == "engine" else engine.optimizer, attr)
    with pytest.raises(patches.DeepSpeedAPIMoved, match=rf"lacks \[.*'{where}\.{attr}'"):
        patches.guard(engine)


def test_the_guard_checks_every_listed_module_symbol(monkeypatch):
    import importlib

    from nshard.seam import patches

    for module_name, symbols in patches.PRIVATE_MODULE_SYMBOLS.items():
        for symbol in symbols:
            with monkeypatch.context() as m:
                m.delattr(importlib.import_module(module_name), symbol)
                with pytest.raises(patches.DeepSpeedAPIMoved, match=re.escape(f"{module_name}.{symbol}")):
                    patches.guard(_complete_engine(0))
    import deepspeed.comm as ds_comm

    for attr in patches.PRIVATE_COMMS_LOGGER_ATTRS:
        with monkeypatch.context() as m:
            m.delattr(ds_comm.comms_logger, attr)
            with pytest.raises(patches.DeepSpeedAPIMoved, match=f"comms_logger.{attr}"):
                patches.guard(_complete_engine(0))


def test_the_guard_warns_outside_the_verified_versions(monkeypatch, capsys):
    import deepspeed

    from nshard.seam import patches

    monkeypatch.setattr(deepspeed, "__version__", "0.21.0")
    patches.guard(_complete_engine(1))
    assert "outside the verified >=0.19.8,<0.20" in capsys.readouterr().err
