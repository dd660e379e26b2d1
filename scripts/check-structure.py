#!/usr/bin/env python3
"""Structure checks run by `make lint`:

- no circle of modules inside a crate (`a` uses `b`, `b` uses `c`, `c`
  uses `a`; two modules using each other the shortest), which would make
  them one room with many doors;
- no Rust file over LIMIT lines unless a line near its top says why
  (`Long because ...` in a comment).
"""

import pathlib
import re
import subprocess
import sys

LIMIT = 600
ROOT = pathlib.Path(__file__).resolve().parent.parent


def tracked_rust_files():
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.rs"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout.split()
    return [ROOT / p for p in out if (ROOT / p).exists()]


def crate_root(path):
    """The `src` (or `tests`, `benches`...) folder a module path is relative to."""
    for parent in path.parents:
        if parent.name in ("src", "fuzz_targets"):
            return parent
    return None


def module_of(path, src):
    rel = path.relative_to(src).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return tuple(parts)


def uses(text, module):
    """Modules named by `crate::x::...` or `super::x` paths in `text`, as
    absolute module paths (first segments only, one level below the
    common parent)."""
    found = set()
    code = "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("//"))
    for m in re.finditer(r"\bcrate::((?:[a-z_][a-z0-9_]*::)*[a-z_][a-z0-9_]*)", code):
        found.add(tuple(m.group(1).split("::")))
    # `use crate::{a, b::c, ...}` lists
    for m in re.finditer(r"use crate::\{(.*?)\};", code, re.S):
        for item in re.findall(r"(?:^|[\s,{])([a-z_][a-z0-9_]*)(?=::|\s*,|\s*\}|\s*$)", m.group(1)):
            found.add((item,))
    for m in re.finditer(r"\bsuper::((?:[a-z_][a-z0-9_]*::)*[a-z_][a-z0-9_]*)", code):
        parent = module[:-1]
        found.add(parent + tuple(m.group(1).split("::")))
    for m in re.finditer(r"use super::\{(.*?)\};", code, re.S):
        parent = module[:-1]
        for item in re.findall(r"(?:^|[\s,{])([a-z_][a-z0-9_]*)(?=::|\s*,|\s*\}|\s*$)", m.group(1)):
            found.add(parent + (item,))
    return found


def circles(edges):
    """Each circle of `edges` (module -> modules it uses), as one path
    around it: Tarjan's strongly connected components, then a shortest way
    round each from its first module, so that the message names real uses."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(set(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    paths = []
    for component in found:
        start = min(component)
        # Breadth first from `start` back to it, within the component.
        previous = {start: None}
        queue, end = [start], None
        while queue and end is None:
            v = queue.pop(0)
            for w in sorted(edges.get(v, ())):
                if w == start:
                    end = v
                    break
                if w in component and w not in previous:
                    previous[w] = v
                    queue.append(w)
        path = []
        while end is not None:
            path.append(end)
            end = previous[end]
        paths.append(path[::-1])
    return sorted(paths)


def main():
    problems = []
    by_crate = {}
    files = tracked_rust_files()
    for path in files:
        text = path.read_text(errors="replace")
        lines = text.count("\n") + 1
        head = "\n".join(text.splitlines()[:15])
        if lines > LIMIT and "Long because" not in head:
            problems.append(f"{path.relative_to(ROOT)}: {lines} lines and no `Long because` near its top")
        src = crate_root(path)
        if src is None:
            continue
        module = module_of(path, src)
        by_crate.setdefault(src, {})[module] = uses(text, module)

    for src, modules in by_crate.items():
        known = set(modules)

        def resolve(target):
            # The longest known module that `target` starts with.
            for n in range(len(target), 0, -1):
                if target[:n] in known:
                    return target[:n]
            return None

        edges = {}
        for module, targets in modules.items():
            for t in targets:
                r = resolve(t)
                if r is not None and r != module and not (
                    r[: len(module)] == module or module[: len(r)] == r
                ):
                    edges.setdefault(module, set()).add(r)
        rel = src.relative_to(ROOT)
        for circle in circles(edges):
            names = " -> ".join("::".join(m) for m in circle + [circle[0]])
            problems.append(f"{rel}: modules use each other in a circle: {names}")

    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"check-structure: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"check-structure: {len(files)} Rust files: fine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
