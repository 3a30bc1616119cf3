"""The module import graph of a crate of this workspace, read from its `use crate::...` and
`crate::...` paths: which module uses which, and the cycles among them.

    python tests/import_graph.py rust/sluice-core      # edges, then cycles (none: exit 0)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PATH = re.compile(r"\bcrate::([a-z_][a-z0-9_]*)")
USE_GROUP = re.compile(r"use crate::\{([^}]*)\}", re.S)


def module_of(src: Path, file: Path) -> str:
    rel = file.relative_to(src).with_suffix("")
    parts = [p for p in rel.parts if p not in ("mod", "lib", "main")]
    return parts[0] if parts else ""


def graph(crate_dir: Path) -> dict[str, set[str]]:
    """Top-level module -> the top-level modules of the same crate it refers to."""
    src = crate_dir / "src"
    edges: dict[str, set[str]] = {}
    for file in sorted(src.rglob("*.rs")):
        me = module_of(src, file)
        if not me:
            continue
        text = file.read_text()
        # Tests inside a file may reach anywhere; only the module's own code counts.
        text = text.split("#[cfg(test)]", 1)[0]
        used = set(PATH.findall(text))
        for group in USE_GROUP.findall(text):
            used.update(re.findall(r"(?:^|,)\s*([a-z_][a-z0-9_]*)", group))
        edges.setdefault(me, set()).update(u for u in used if u != me)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def main() -> int:
    crate_dir = Path(sys.argv[1])
    edges = graph(crate_dir)
    for m in sorted(edges):
        print(f"{m} -> {', '.join(sorted(edges[m])) or '(nothing)'}")
    found = cycles(edges)
    for c in found:
        print("cycle: " + " <-> ".join(c))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
