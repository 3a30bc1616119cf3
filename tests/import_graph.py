"""The module import graph of a crate of this workspace, read from its `use crate::...` and
`crate::...` paths: which module uses which, and the cycles among them.

    python tests/import_graph.py rust/sluice-core      # edges, then cycles (none: exit 0)

Folded to top-level modules, that graph cannot see two files of one module that use each other
(iproto::select and iproto::write, say). The file graphs below can: one node per file, of a
crate (`rust_file_graph`) or of the Python package (`python_file_graph`).

    python tests/import_graph.py --files               # every crate and python/sluice
    python tests/import_graph.py --files rust/sluice-server python/sluice
                                                       # their cycles (none: exit 0)
"""

from __future__ import annotations

import ast
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


# -- one node per file: Rust


def file_module(src: Path, file: Path) -> str:
    """A file's module path in its crate: a/b.rs and a/b/mod.rs are both `a::b`, lib.rs and
    main.rs the crate's root `""`."""
    parts = list(file.relative_to(src).with_suffix("").parts)
    if parts[-1] == "mod" or parts == ["lib"] or parts == ["main"]:
        parts.pop()
    return "::".join(parts)


# What may hold `//` or `/*` without starting a comment (raw, byte and plain strings, character
# literals, which a lifetime such as 'a never completes), or what starts a comment.
RUST_TOKEN = re.compile(
    r"""(?P<keep>(?<!\w)b?r(?P<hashes>#*)".*?"(?P=hashes)|b?"(?:\\.|[^"\\])*"|b?'(?:\\.|[^\\'\n])')"""
    r"|(?P<line>//[^\n]*)|(?P<block>/\*)",
    re.S,
)


def _block_comment_end(text: str, i: int) -> int:
    """Where the block comment opened just before `i` ends: Rust's block comments nest."""
    depth = 1
    while depth and i < len(text):
        if text.startswith("/*", i):
            depth, i = depth + 1, i + 2
        elif text.startswith("*/", i):
            depth, i = depth - 1, i + 2
        else:
            i += 1
    return i


def strip_rust_comments(text: str) -> str:
    """The code without its comments: a doc comment's intra-doc link ([`crate::x::Y`]) is no
    use of x. Strings stay as they are: an attribute may name a path in one (serde's `with`)."""
    out, i = [], 0
    while m := RUST_TOKEN.search(text, i):
        out.append(text[i : m.start()])
        if m["keep"]:
            out.append(m[0])
            i = m.end()
        else:
            out.append(" ")
            i = m.end() if m["line"] else _block_comment_end(text, m.end())
    out.append(text[i:])
    return "".join(out)


IDENT = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*")
ALIAS = re.compile(r"\s*as\s+[A-Za-z_][A-Za-z0-9_]*\s*")
# A path from the crate's root or from the file's parent module (`super::super::` climbs two).
# `(?<!::)` leaves the second `super` of such a path to the first.
ROOTED = re.compile(r"(?<!::)\b(crate|super)((?:\s*::\s*super\b)*)\s*::")


def _use_tree(text: str, i: int) -> tuple[list[list[str]], int]:
    """The paths named by what follows a `::` at `i`, and where they end: a plain path
    (`a::b::Item`, maybe `as` another name), a glob, or a group (`{a, b::{c, d}}`), which names
    each of its paths: `use crate::{kv, iproto::select}` uses both kv and iproto::select. What is
    not a path (`Thing::<T>`'s generics) ends it."""
    while i < len(text) and text[i].isspace():
        i += 1
    if text.startswith("*", i):
        return [[]], i + 1
    if text.startswith("{", i):
        return _use_group(text, i + 1)
    m = IDENT.match(text, i)
    if not m:
        return [[]], i
    head, i = m[1], m.end()
    if text.startswith("::", i):
        rest, i = _use_tree(text, i + 2)
        return [[head, *p] for p in rest], i
    alias = ALIAS.match(text, i)
    return [[head]], alias.end() if alias else i


def _use_group(text: str, i: int) -> tuple[list[list[str]], int]:
    """The paths of a `{...}` group whose `{` ends at `i`, and where its `}` ends."""
    paths: list[list[str]] = []
    while i < len(text) and text[i] != "}":
        inner, j = _use_tree(text, i)
        paths += [p for p in inner if p]
        while j < len(text) and text[j] in ", \t\r\n":
            j += 1
        i = j if j > i else i + 1  # what no use group holds: stepped over, never stuck on
    return paths, i + 1


def rust_paths(module: str, text: str) -> list[list[str]]:
    """The absolute paths (from the crate's root) that a file's code names through `crate::` or
    `super::`: each a list of segments, modules first, maybe an item after them."""
    parent = module.split("::")[:-1] if module else []
    paths = []
    for m in ROOTED.finditer(text):
        if m[1] == "crate":
            base: list[str] | None = []
        else:
            up = 1 + m[2].count("super")
            base = parent[: len(parent) - (up - 1)] if module and up <= len(parent) + 1 else None
        tails, _ = _use_tree(text, m.end())
        if base is not None:  # `super` above the root names nothing
            paths += [base + tail for tail in tails]
    return paths


def resolve(path: list[str], modules: set[str], sep: str) -> str | None:
    """The module a path lands in: its longest prefix that is a module (what follows is an item,
    `self`, a glob's end); None when not even its first segment is one."""
    for k in range(len(path), -1, -1):
        name = sep.join(path[:k])
        if name in modules:
            return name
    return None


def is_ancestor(a: str, b: str, sep: str) -> bool:
    """Whether module a is module b's parent, or its parent's, and so on."""
    return b.startswith(a + sep)


def rust_file_graph(crate_dir: Path) -> dict[str, set[str]]:
    """File (by module path) -> the files of the same crate its code uses, outside its tests.
    A use of the root, or of a module's own ancestors, is no edge: a child using its parent's
    items is how Rust modules are built (the parent declares the child), not a circle."""
    src = crate_dir / "src"
    files = {file_module(src, f): f for f in sorted(src.rglob("*.rs"))}
    edges: dict[str, set[str]] = {}
    for me, file in files.items():
        text = strip_rust_comments(file.read_text())
        # Tests inside a file may reach anywhere; only the file's own code counts.
        text = text.split("#[cfg(test)]", 1)[0]
        used = {resolve(path, set(files), "::") for path in rust_paths(me, text)}
        edges[me] = {u for u in used if u and u != me and not is_ancestor(u, me, "::")}
    return edges


# -- one node per file: Python


def python_modules(package: Path) -> dict[str, Path]:
    """Every module of a package by its dotted name (sluice.cluster.member; a package's
    __init__.py is the package). A stub without a .py beside it (sluice/_native.pyi) stands for
    a compiled module: a node of its own, so that importing it is no use of sluice/__init__.py."""
    modules: dict[str, Path] = {}
    for file in sorted(package.rglob("*.py*")):
        if file.suffix not in (".py", ".pyi") or (file.suffix == ".pyi" and file.with_suffix(".py").exists()):
            continue
        parts = [package.name, *file.relative_to(package).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = file
    return modules


def _imported_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute name a `from X import` names: `.` is the importing module's package (the
    module itself for an __init__.py), each further dot one package up."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: max(0, len(package) - (node.level - 1))]
    return ".".join([*base, *([node.module] if node.module else [])])


def python_imports(module: str, is_package: bool, tree: ast.AST) -> set[str]:
    """The dotted names a module imports, anywhere in it: an import inside a function, or under
    `if TYPE_CHECKING`, ties the two files as much as one at the top. `from X import name`
    imports X.name when that is a submodule, else X (name is X's attribute)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _imported_from(module, is_package, node)
            names.update(f"{base}.{alias.name}" if alias.name != "*" else base for alias in node.names)
    return names


def python_file_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports. Unlike Rust's, an import of an
    ancestor counts: Python runs a package's __init__.py before its modules, so one that imports
    a module importing back from it is a circle (its names may not be there yet)."""
    modules = python_modules(package)
    edges: dict[str, set[str]] = {}
    for me, file in modules.items():
        tree = ast.parse(file.read_text(), str(file))
        imported = python_imports(me, file.name.startswith("__init__."), tree)
        used = {resolve(name.split("."), set(modules), ".") for name in imported}
        edges[me] = {u for u in used if u and u != me}
    return edges


def file_cycles(root: Path) -> list[str]:
    """Every circle of files, of every crate under rust/ and of python/sluice, as
    `crate: a <-> b` lines."""
    found = []
    for src in sorted(root.glob("rust/*/src")):
        found += [f"{src.parent.name}: {' <-> '.join(c)}" for c in cycles(rust_file_graph(src.parent))]
    package = root / "python" / "sluice"
    found += [f"python/sluice: {' <-> '.join(c)}" for c in cycles(python_file_graph(package))]
    return found


def main_files(dirs: list[str]) -> int:
    """`--files [DIR...]`: the circles of files of each crate or Python package named (none
    named: every crate and python/sluice)."""
    if not dirs:
        found = file_cycles(Path(__file__).resolve().parent.parent)
    else:
        found = []
        for d in map(Path, dirs):
            edges = rust_file_graph(d) if (d / "src").is_dir() else python_file_graph(d)
            found += [f"{d}: {' <-> '.join(c)}" for c in cycles(edges)]
    for line in found:
        print("cycle: " + line)
    return 1 if found else 0


def main() -> int:
    if sys.argv[1:2] == ["--files"]:
        return main_files(sys.argv[2:])
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
