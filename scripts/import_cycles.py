#!/usr/bin/env python3
"""Fails when two or more files of src/ import each other in a circle.

Each file is a module (src/a/b.rs and src/a/b/mod.rs are `a::b`); an edge
goes from a file to every module its `use` items, paths and `super::`
references name (to the deepest module that is a file). Child modules
declared in a file (`mod x;`) are not edges of their parent, and tests
(`#[cfg(test)]` modules at the end of a file) are left out: they may use
anything. Prints each circle found; exit status 1 when there is one.

    python3 scripts/import_cycles.py [src]
"""
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "src")


def module_of(path):
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] in ("mod", "lib"):
        parts = parts[:-1]
    return tuple(parts)


files = {module_of(p): p for p in root.rglob("*.rs")}


def resolve(base, segments):
    """The deepest file module named by `segments` from module `base`."""
    path = list(base)
    segs = list(segments)
    if segs and segs[0] == "crate":
        path, segs = [], segs[1:]
    elif segs and segs[0] == "self":
        segs = segs[1:]
    else:
        while segs and segs[0] == "super":
            path = path[:-1]
            segs = segs[1:]
        if segments and segments[0] not in ("super",):
            return None  # an external crate or std
    best = None
    for s in segs:
        path = path + [s]
        if tuple(path) in files:
            best = tuple(path)
    return best


def code_of(text):
    # Leave out the test module and comments.
    text = re.split(r"\n#\[cfg\(test\)\]\s*\nmod tests", text)[0]
    return re.sub(r"//[^\n]*", "", text)


edges = {}
for mod, path in files.items():
    text = code_of(path.read_text())
    # A file that is a module's mod.rs resolves `super` from itself.
    base = list(mod)
    deps = set()
    for m in re.finditer(r"\b((?:crate|super)(?:::\w+)+)", text):
        segs = m.group(1).split("::")
        target = resolve(base if path.name != "mod.rs" else base, segs)
        if target and target != mod and not (target[: len(mod)] == mod):
            deps.add(target)
    for m in re.finditer(r"use\s+(crate|super)::\{([^;]*)\};", text, re.S):
        for item in re.split(r",", m.group(2)):
            segs = [m.group(1)] + [x for x in re.split(r"::", item.strip().split(" ")[0]) if x and x != "{"]
            target = resolve(base, segs)
            if target and target != mod and not (target[: len(mod)] == mod):
                deps.add(target)
    edges[mod] = deps

# A module's parent reaches its children through `mod`, not through imports.
cycles = []
index, low, stack, on, counter = {}, {}, [], set(), [0]


def strong(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in edges.get(v, ()):
        if w not in index:
            strong(w)
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
            cycles.append(comp)


sys.setrecursionlimit(10000)
for v in sorted(edges):
    if v not in index:
        strong(v)

for c in cycles:
    print("import circle: " + " <-> ".join("::".join(m) or "crate" for m in sorted(c)))
print(f"import_cycles: {len(files)} files, {sum(len(d) for d in edges.values())} imports, {len(cycles)} circle(s)")
sys.exit(1 if cycles else 0)
