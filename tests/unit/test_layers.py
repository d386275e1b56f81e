"""The import graph goes one way: a module never imports a layer above its own, and the product never
imports the simulator or the dev tools.

    foundation (errors, secret, paths) < config < render < host < probe < plan < ops < bench < cli

Every import counts, module-level or inside a function (a lazy import is still a dependency), and so
does a module path named as a string to importlib. The simulator (orchestrator.sim) and the dev tools
(orchestrator.devtools) may import the product; the product reaches them only through the CLI's lazy
command table, which names `orchestrator.sim.cli:sim` as a string and is allowed below by name.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "orchestrator"

LAYERS = ["foundation", "config", "render", "host", "probe", "plan", "ops", "bench", "cli"]
FOUNDATION = {"orchestrator", "orchestrator.errors", "orchestrator.secret", "orchestrator.paths", "orchestrator.fmt"}
OUTSIDE_PRODUCT = ("orchestrator.sim", "orchestrator.devtools")

# The one place the product names the simulator: the lazy `vllm-orch sim` command, as a string.
ALLOWED_STRINGS = {("orchestrator.cli.main", "orchestrator.sim.cli")}

# Imports that go the wrong way today, being fixed by the layout rework (issue 10). Each is
# (importing module, imported module). Empty this list as they are fixed; the test fails when an
# entry is no longer needed, so the list cannot go stale.
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()


def layer_of(module: str) -> str | None:
    """The layer of a product module; None for the simulator and the dev tools (not the product)."""
    if module in FOUNDATION:
        return "foundation"
    if module.startswith(OUTSIDE_PRODUCT):
        return None
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in LAYERS:
        return parts[1]
    raise AssertionError(f"{module} is in no layer: add it to LAYERS or FOUNDATION in this test")


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(path: Path) -> list[tuple[str, int, str]]:
    """(imported module, line, how) for every import in the file, wherever it is."""
    module = module_name(path)
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[str, int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno, "import") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path.name == "__init__.py", node)
            found.append((target, node.lineno, "import"))
            # `from orchestrator.x import y` may import the submodule orchestrator.x.y
            found += [(f"{target}.{a.name}", node.lineno, "import") for a in node.names
                      if (PACKAGE.parent / (target + "." + a.name).replace(".", "/")).with_suffix(".py").exists()
                      or (PACKAGE.parent / (target + "." + a.name).replace(".", "/")).is_dir()]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.startswith("orchestrator."):
            named = node.value.split(":")[0]
            if all(p.isidentifier() for p in named.split(".")):
                found.append((named, node.lineno, "string"))
    return [(t, line, how) for t, line, how in found if t == "orchestrator" or t.startswith("orchestrator.")]


def product_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py")
                  if not module_name(p).startswith(OUTSIDE_PRODUCT) and "_shipped" not in p.parts)


def violations() -> dict[tuple[str, str], str]:
    """(importer, imported) -> 'file:line: why' for every import that breaks the layering."""
    out: dict[tuple[str, str], str] = {}
    for path in product_files():
        src = module_name(path)
        src_layer = layer_of(src)
        for target, line, how in imports_of(path):
            where = f"{path.relative_to(PACKAGE.parent)}:{line}"
            if target.startswith(OUTSIDE_PRODUCT):
                if how == "string" and (src, target) in ALLOWED_STRINGS:
                    continue
                out[(src, target)] = f"{where}: the product ({src}) imports {target}"
                continue
            tgt_layer = layer_of(target)
            if tgt_layer is not None and LAYERS.index(tgt_layer) > LAYERS.index(src_layer):
                out.setdefault((src, target), f"{where}: {src} ({src_layer}) imports {target} "
                                              f"({tgt_layer}), a layer above")
    return out


def test_the_checker_sees_every_kind_of_import(tmp_path, monkeypatch):
    """The walker finds module-level, function-local, relative and string imports."""
    pkg = tmp_path / "orchestrator" / "config"
    pkg.mkdir(parents=True)
    (tmp_path / "orchestrator" / "__init__.py").write_text("")
    (tmp_path / "orchestrator" / "plan").mkdir()
    (tmp_path / "orchestrator" / "plan" / "steps.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "x.py").write_text(
        "import orchestrator.errors\n"
        "def f():\n    from orchestrator.plan import steps\n"
        "from .yamlsrc import YamlDoc\n"
        "LAZY = 'orchestrator.sim.cli:sim'\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "orchestrator")
    got = {(t, how) for t, _line, how in imports_of(pkg / "x.py")}
    assert got == {("orchestrator.errors", "import"), ("orchestrator.plan", "import"),
                   ("orchestrator.plan.steps", "import"), ("orchestrator.config.yamlsrc", "import"),
                   ("orchestrator.sim.cli", "string")}


def test_every_product_module_is_in_a_layer():
    for path in product_files():
        layer_of(module_name(path))


def test_imports_go_one_way_and_never_into_sim_or_devtools():
    found = violations()
    new = {k: v for k, v in found.items() if k not in KNOWN_VIOLATIONS}
    assert not new, "imports against the layering:\n" + "\n".join(sorted(new.values()))


def test_known_violations_are_still_real():
    """An allow-list entry that no longer matches an import must be removed from the list."""
    fixed = KNOWN_VIOLATIONS - set(violations())
    assert not fixed, f"{sorted(fixed)} are fixed: remove them from KNOWN_VIOLATIONS"
