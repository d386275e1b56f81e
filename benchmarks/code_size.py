"""The product's size: lines per package (config, render, host, probe, plan, ops, cli) and the
functions longer than 80 lines. Prints figures (docs/figures.md, "Code size"); the same script
measures before and after a refactoring.

  python benchmarks/code_size.py [--root orchestrator] [--list]
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

PACKAGES = ("config", "render", "host", "probe", "plan", "ops", "cli")
LONG = 80


def lines(path: Path) -> tuple[int, int]:
    """(all lines, code lines: neither blank nor a comment)."""
    text = path.read_text().splitlines()
    code = [t for t in text if t.strip() and not t.lstrip().startswith("#")]
    return len(text), len(code)


def long_functions(path: Path, limit: int = LONG) -> list[tuple[str, int]]:
    """(qualified name, length in lines) of every function or method over `limit` lines."""
    tree = ast.parse(path.read_text())
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (child.end_lineno or child.lineno) - child.lineno + 1
                if n > limit:
                    out.append((f"{prefix}{child.name}", n))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
    visit(tree, "")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=str(Path(__file__).resolve().parent.parent / "orchestrator"))
    ap.add_argument("--list", action="store_true", help="name every function over 80 lines")
    args = ap.parse_args()
    root = Path(args.root)
    total = [0, 0]
    longs: list[tuple[str, int]] = []
    print(f"{'package':<8} {'files':>5} {'lines':>7} {'code':>7} {'fn>80':>6}")
    for pkg in PACKAGES:
        files = sorted((root / pkg).rglob("*.py"))
        n_all = n_code = 0
        pkg_long: list[tuple[str, int]] = []
        for f in files:
            a, c = lines(f)
            n_all, n_code = n_all + a, n_code + c
            pkg_long += [(f"{f.relative_to(root)}:{name}", n) for name, n in long_functions(f)]
        total[0] += n_all
        total[1] += n_code
        longs += pkg_long
        print(f"{pkg:<8} {len(files):>5} {n_all:>7} {n_code:>7} {len(pkg_long):>6}")
    print(f"{'total':<8} {'':>5} {total[0]:>7} {total[1]:>7} {len(longs):>6}")
    if args.list:
        for name, n in sorted(longs, key=lambda x: -x[1]):
            print(f"  {n:>4}  {name}")


if __name__ == "__main__":
    main()
