"""Facts about polyrl's code, read from the source alone (AST + import graph, stdlib only; nothing is imported).

    python scripts/code_facts.py [--root CHECKOUT] [--json]

What it measures, and exactly how:

(a) Import cycles. Nodes are the modules under polyrl/ (`pkg/__init__.py` is the module `pkg`). An edge A -> B means
    A's source has `import B...` or `from B import ...` (relative imports resolved; `from pkg import name` points at
    `pkg.name` when that is a module, else at `pkg`). Importing `a.b.c` also runs `a/__init__` and `a/b/__init__`, but
    those implicit edges are not drawn: a cycle here is one that the code's own import lines close. Imports under
    `if TYPE_CHECKING:` are skipped (they never run). A cycle is a strongly connected component with more than one
    module. Two graphs: "all" counts imports inside function bodies too (they run on first call and still tie the
    modules together); "top-level" counts only imports that run when the module is imported. A cycle is flagged
    when it holds a CLI module: polyrl.cli, polyrl.train, polyrl.__main__, or any module named `cli` or `*_cli`.

(b) Upward imports from distributed/: modules under polyrl.distributed with an edge (all graph, direct) to a module
    under polyrl.trainer (or the older polyrl.flow) or to a CLI module. The same, wider: any module outside those
    (learner, rollout, algorithms, models, rewards, data, utils, report, config) with such an edge.

(c) Config classes defined more than once: classes decorated with `@dataclass` whose name ends in `Config`, grouped by
    name; a name defined in two or more places is listed with each place.

(d) Files a config key passes through, from `polyrl train`'s command line to its use. The value enters as text on the
    command line (polyrl/cli.py), is parsed into the config tree by the generic `build_config` (polyrl/config.py,
    which names no key), and from there is read and handed on by name. A file is counted when it is in the import
    closure of `polyrl train` (everything polyrl/cli.py's `_train` imports, transitively, function-local imports
    included) and it handles the value by one of the key's names:
      - reads it as an attribute (`x.clip_ratio`) or with `getattr(x, "clip_ratio")` / `x["clip_ratio"]`;
      - passes it on as a keyword argument (`f(clip_ratio=...)`) or receives it as a parameter or local name;
    where "the key's names" start as its leaf (`clip_ratio`) and grow by hand copies: `k=<a read of a name>` in a call,
    `k = <read>` / `self.k = <read>` assignments and `{"k": <read>}` dict entries add `k`, and a function or property
    `k` that returns a read adds `k` (the read may be wrapped in `float()`, `int()`, `bool()` or a conditional
    expression); a positional argument adds the parameter it lands in (callees are resolved by name among the
    closure's functions) as a name followed inside that function only. This repeats until nothing new is found.
    Reads through another config section that has a key with the same leaf (`val_kwargs.temperature`) are a
    different key and are left out. The dataclass field that declares the key is not a read. The files are listed
    with the lines that matched; the count says how many places a reader must visit to follow the key, and how many
    a rename of it would touch.

(e) Basic statistics: number of .py files and lines under polyrl/, number of functions (methods and nested functions
    included) and their median length in lines (`def` to last line, decorators excluded).
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

KEYS = {  # key -> receivers of the same leaf name that belong to a different key
    "actor_rollout_ref.actor.clip_ratio": (),
    "actor_rollout_ref.rollout.temperature": ("val_kwargs", "val_sampling", "val_sp"),
    "algorithm.adv_estimator": (),
}
TRAIN_ENTRY = "polyrl.cli"
TRAIN_FUNCTION = "_train"  # `polyrl train`'s handler in polyrl/cli.py: its imports root the closure of (d)
UPPER_PACKAGES = ("polyrl.trainer", "polyrl.flow")  # loops; distributed/ must not import them


# ------------------------------------------------------------------------------------------------ parsing
@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    is_package: bool
    imports: list[tuple[str, bool, int]] = field(default_factory=list)  # (target module, top-level?, line)


def module_name(path: Path, src_root: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(src_root).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join(parts), is_package


def load_modules(root: Path) -> dict[str, Module]:
    mods = {}
    for path in sorted((root / "polyrl").rglob("*.py")):
        name, is_package = module_name(path, root)
        mods[name] = Module(name, path, ast.parse(path.read_text(), str(path)), is_package)
    return mods


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST, in_function: bool = False):
    """(import node, inside a function body?) for every import that can run."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for sub in child.orelse:
                yield from _import_nodes(ast.Module(body=[sub], type_ignores=[]), in_function)
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function
        nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from _import_nodes(child, nested)


def _resolve(mod: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.name.split(".") if mod.is_package else mod.name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _known(name: str, mods: dict[str, Module]) -> str | None:
    """The longest prefix of `name` that is a polyrl module (`polyrl.x.y.func` -> `polyrl.x.y`)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in mods:
            return ".".join(parts[:i])
    return None


def collect_imports(mods: dict[str, Module]) -> None:
    for mod in mods.values():
        for node, in_function in _import_nodes(mod.tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = _resolve(mod, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                known = _known(t, mods)
                if known and known != mod.name:
                    mod.imports.append((known, not in_function, node.lineno))


def graph(mods: dict[str, Module], top_level_only: bool) -> dict[str, set[str]]:
    return {m.name: {t for t, top, _ in m.imports if top or not top_level_only} for m in mods.values()}


def is_cli(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return name in ("polyrl.cli", "polyrl.train", "polyrl.__main__") or last == "cli" or last.endswith("_cli")


# ------------------------------------------------------------------------------------------------ (a) cycles
def strongly_connected(g: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one node, each sorted, largest first."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in sorted(g):
        if start in index:
            continue
        work = [(start, iter(sorted(g[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(g.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return sorted(out, key=lambda c: (-len(c), c))


def cycles(mods: dict[str, Module]) -> dict[str, list[dict]]:
    out = {}
    for label, top_only in (("all", False), ("top_level", True)):
        out[label] = [{"modules": c, "size": len(c), "cli": [m for m in c if is_cli(m)]}
                      for c in strongly_connected(graph(mods, top_only))]
    return out


# ------------------------------------------------------------------------------------------------ (b) upward imports
def _is_loop_or_cli(name: str) -> bool:
    return name.startswith(UPPER_PACKAGES) or is_cli(name)


def upward_imports(mods: dict[str, Module], under: str | None = "polyrl.distributed") -> list[dict]:
    """Edges from modules under `under` (None: every module that is not a loop, a CLI or the root package) to a
    loop or CLI module."""
    out = []
    for mod in mods.values():
        if under is None:
            inside = not (_is_loop_or_cli(mod.name) or mod.name == "polyrl")
        else:
            inside = mod.name == under or mod.name.startswith(f"{under}.")
        if not inside:
            continue
        for target, top, line in mod.imports:
            if _is_loop_or_cli(target):
                out.append({"module": mod.name, "imports": target, "line": line, "top_level": top})
    return out


# ------------------------------------------------------------------------------------------------ (c) config classes
def _is_dataclass(cls: ast.ClassDef) -> bool:
    for d in cls.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        if (d.id if isinstance(d, ast.Name) else getattr(d, "attr", None)) == "dataclass":
            return True
    return False


def config_classes(mods: dict[str, Module], root: Path) -> dict[str, list[str]]:
    seen: dict[str, list[str]] = {}
    for mod in mods.values():
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Config") and _is_dataclass(node):
                seen.setdefault(node.name, []).append(f"{mod.path.relative_to(root)}:{node.lineno}")
    return seen


# ------------------------------------------------------------------------------------------------ (d) key paths
def train_closure(mods: dict[str, Module]) -> set[str]:
    entry = mods[TRAIN_ENTRY]
    fn = next(n for n in ast.walk(entry.tree) if isinstance(n, ast.FunctionDef) and n.name == TRAIN_FUNCTION)
    roots = {t for t, _, line in entry.imports if fn.lineno <= line <= fn.end_lineno}
    g, seen, todo = graph(mods, top_level_only=False), {TRAIN_ENTRY}, list(roots)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += g.get(m, ())
    return seen


def _dotted(node: ast.AST) -> list[str]:
    out = []
    while isinstance(node, ast.Attribute):
        out.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        out.append(node.id)
    return out[::-1]


def _read_names(node: ast.AST, names: set[str], other: tuple[str, ...]) -> bool:
    """Is `node` a read of one of `names` (possibly wrapped in float()/int()/bool() or `a if c else b`)?"""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("float", "int", "bool") \
            and len(node.args) == 1:
        return _read_names(node.args[0], names, other)
    if isinstance(node, ast.IfExp):
        return _read_names(node.body, names, other) or _read_names(node.orelse, names, other)
    if isinstance(node, ast.Attribute):
        return node.attr in names and not set(_dotted(node.value)) & set(other)
    if isinstance(node, ast.Name):
        return node.id in names
    return False


def _string_key(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _functions(closure: list[Module]) -> dict[str, list[ast.FunctionDef]]:
    out: dict[str, list] = {}
    for m in closure:
        for n in ast.walk(m.tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.setdefault(n.name, []).append(n)
    return out


def _params(fn: ast.FunctionDef, via_attribute: bool) -> list[str]:
    names = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    return names[1:] if via_attribute and names[:1] in (["self"], ["cls"]) else names


class _Trace:
    """One pass over a module: the lines that handle the value, and the new names it is copied into.

    `names` are followed everywhere (attributes, keywords, dict keys cross files); `local[id(fn)]` are parameter
    names a positional argument put the value in, followed inside that function only."""

    def __init__(self, names: set[str], local: dict[int, set[str]], other: tuple[str, ...], functions):
        self.names, self.local, self.other, self.functions = names, local, other, functions
        self.lines: set[int] = set()
        self.new: set[str] = set()
        self.new_local: dict[int, set[str]] = {}

    def visit(self, node: ast.AST, names: set[str], dataclass_body: bool = False, fn: str | None = None) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names, fn = names | self.local.get(id(node), set()), node.name
        if isinstance(node, ast.Return) and fn and node.value is not None and self.read(node.value, names):
            self.new.add(fn)  # a property or getter that returns the value hands it on under its own name
        self.check(node, names, dataclass_body)
        is_dc = isinstance(node, ast.ClassDef) and _is_dataclass(node)
        for child in ast.iter_child_nodes(node):
            self.visit(child, names, is_dc and child in node.body, fn)

    def read(self, node: ast.AST, names: set[str]) -> bool:
        return _read_names(node, names, self.other)

    def check(self, node: ast.AST, names: set[str], dataclass_body: bool) -> None:
        lines, read = self.lines, self.read
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and read(node, names):
            lines.add(node.lineno)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in names:
            lines.add(node.lineno)
        elif isinstance(node, ast.keyword) and node.arg:
            if node.arg in names:
                lines.add(node.value.lineno)
            if read(node.value, names):
                self.new.add(node.arg)
        elif isinstance(node, ast.arg) and node.arg in names:
            lines.add(node.lineno)
        elif isinstance(node, ast.Subscript) and _string_key(node.slice) in names:
            lines.add(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and read(node.value, names):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(t, (ast.Name, ast.Attribute)):
                    self.new.add(t.id if isinstance(t, ast.Name) else t.attr)
        elif isinstance(node, ast.AnnAssign) and not dataclass_body and isinstance(node.target, ast.Name) \
                and node.target.id in names:
            lines.add(node.lineno)
        elif isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if k is not None and _string_key(k) and read(v, names):
                    self.new.add(_string_key(k))
        elif isinstance(node, ast.Call):
            self.call(node, names)

    def call(self, node: ast.Call, names: set[str]) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("getattr", "hasattr") and len(node.args) >= 2 \
                and _string_key(node.args[1]) in names:
            self.lines.add(node.lineno)
            return
        callee = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        for i, arg in enumerate(node.args):
            if not self.read(arg, names):
                continue
            for fn in self.functions.get(callee, ()):  # resolved by name: every def of that name in the closure
                params = _params(fn, isinstance(func, ast.Attribute))
                if i < len(params) and params[i] not in self.local.get(id(fn), set()):
                    self.new_local.setdefault(id(fn), set()).add(params[i])


def key_paths(mods: dict[str, Module], root: Path) -> dict[str, dict]:
    closure = [mods[m] for m in sorted(train_closure(mods))]
    functions = _functions(closure)
    out = {}
    for key, other in KEYS.items():
        names, local = {key.rsplit(".", 1)[-1]}, {}
        while True:
            traces = {m.name: _Trace(names, local, other, functions) for m in closure}
            for m in closure:
                traces[m.name].visit(m.tree, names)
            new = set().union(*(t.new for t in traces.values())) - names
            new_local = {k: v for t in traces.values() for k, v in t.new_local.items()}
            if not new and not new_local:
                break
            names = names | new
            for k, v in new_local.items():
                local[k] = local.get(k, set()) | v
        files = {str(m.path.relative_to(root)): sorted(traces[m.name].lines) for m in closure if traces[m.name].lines}
        params = sorted({p for v in local.values() for p in v})
        out[key] = {"count": len(files), "names": sorted(names), "parameters": params, "files": files}
    return out


# ------------------------------------------------------------------------------------------------ (e) stats
def stats(mods: dict[str, Module]) -> dict:
    lengths = [n.end_lineno - n.lineno + 1 for m in mods.values() for n in ast.walk(m.tree)
               if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return {"files": len(mods), "lines": sum(len(m.path.read_text().splitlines()) for m in mods.values()),
            "functions": len(lengths), "median_function_lines": statistics.median(lengths) if lengths else 0}


# ------------------------------------------------------------------------------------------------ report
def facts(root: Path) -> dict:
    mods = load_modules(root)
    collect_imports(mods)
    defined = config_classes(mods, root)
    return {
        "cycles": cycles(mods),
        "distributed_upward_imports": upward_imports(mods),
        "lower_layer_upward_imports": upward_imports(mods, under=None),
        "duplicate_config_classes": {k: v for k, v in sorted(defined.items()) if len(v) > 1},
        "config_classes": len(defined),
        "key_paths": key_paths(mods, root),
        "stats": stats(mods),
    }


def render(f: dict) -> str:
    out = []
    for label in ("all", "top_level"):
        cs = f["cycles"][label]
        out.append(f"(a) import cycles, {label.replace('_', '-')} imports: {len(cs)}"
                   f" ({sum(bool(c['cli']) for c in cs)} with a CLI module)")
        for c in cs:
            flag = f"  <- CLI: {', '.join(c['cli'])}" if c["cli"] else ""
            out.append(f"    {c['size']:>3} modules: {', '.join(c['modules'])}{flag}")
    up = f["distributed_upward_imports"]
    out.append(f"(b) distributed/ modules importing a trainer or CLI module: {len(up)}")
    for u in up:
        where = "top-level" if u["top_level"] else "in a function"
        out.append(f"    {u['module']} -> {u['imports']} (line {u['line']}, {where})")
    low = f["lower_layer_upward_imports"]
    out.append(f"(b) any module below the loops and CLI importing one: {len(low)}")
    for u in low:
        where = "top-level" if u["top_level"] else "in a function"
        out.append(f"    {u['module']} -> {u['imports']} (line {u['line']}, {where})")
    dup = f["duplicate_config_classes"]
    out.append(f"(c) @dataclass *Config names defined more than once: {len(dup)} (of {f['config_classes']} names)")
    for name, places in dup.items():
        out.append(f"    {name}: {', '.join(places)}")
    out.append("(d) files a key passes through from `polyrl train` to its use (names followed)")
    for key, kp in f["key_paths"].items():
        via = f"; parameters {', '.join(kp['parameters'])}" if kp["parameters"] else ""
        out.append(f"    {key}: {kp['count']} files (names {', '.join(kp['names'])}{via})")
        for path, lines in kp["files"].items():
            shown = ", ".join(map(str, lines[:8])) + (", ..." if len(lines) > 8 else "")
            out.append(f"        {path}: {shown}")
    s = f["stats"]
    out.append(f"(e) {s['files']} files, {s['lines']} lines, {s['functions']} functions, "
               f"median function {s['median_function_lines']:g} lines")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent, help="checkout to measure")
    p.add_argument("--json", action="store_true", help="print the facts as JSON instead of a table")
    args = p.parse_args(argv)
    f = facts(args.root.resolve())
    print(json.dumps(f, indent=1) if args.json else render(f))
    return 0


if __name__ == "__main__":
    sys.exit(main())
