"""Every key of `polyrl keys train|sft|flow` is read by the code or refused by a check (STYLE.md rule 13).

The method, static and fast (AST only, nothing is trained):

1. The leaves. Each tree (`PPOConfig`, `SFTConfig`, `FlowConfig`) is walked to its leaf keys, e.g.
   `actor_rollout_ref.actor.fsdp_config.forward_prefetch`: the leaf name `forward_prefetch`, its parent group
   `fsdp_config`, and the dataclass that defines it (`FSDPConfig`).
2. The readers. A tree is read by the modules its trainer imports: the import closure (module-level and
   function-local imports alike) of the tree's entry modules, plus `polyrl/cli.py`, whose imports are not followed
   because it dispatches to every trainer. So `data.val_files` read by the RL trainer does not count for `polyrl sft`.
3. The reads. In those modules, every attribute load `x.name` and `getattr(x, "name")` is a read, with a hint of
   what `x` is: the last attribute of its dotted chain after expanding local aliases (`a = cfg.actor_rollout_ref.actor`
   then `a.clip_ratio` is read on `actor`), or the class a parameter is annotated with (`fsdp: FSDPConfig`).
   Stores (`cfg.x = ...`) are not reads. Field declarations are not reads; methods of config classes are (a property
   such as `FSDPConfig.cpu_offload` reads its fields on `self`). Whole-tree dumps (`to_dict`, `save_config`) are not
   attribute reads, so copying a config into config.yaml or a tracker never counts as reading it.
4. A key is read when its leaf is read on its parent group's name or its class, or, when the receiver is a plain
   name the AST cannot type (`cfg.x`, `c.enable`), when no other class of that tree has a field of that name or the
   module names the key's class (imports it, annotates with it); and when every group on its path is read the same
   way (`critic.model.fsdp_config` needs a `.fsdp_config`
   read on a `model`: reading the actor's FSDP settings does not read the critic's).
   A read inside a call that also names the full key in a string (`to_dtype(cfg.dtype,
   "actor_rollout_ref.rollout.dtype")`, the user-error convention) reads that key whatever the receiver is.
5. A key that is not read must be refused: it is in `polyrl.trainer.key_checks.REFUSED_KEYS` (keys refused when set to
   anything but their default), and this test sets each of them to a non-default value and asserts the tree's check
   raises a ConfigError naming the key.

Limits (why this is a lint, not a proof): reads are matched by name and receiver, not by type inference, so two
groups with the same name in one tree (`actor_rollout_ref.rollout` and the top-level `rollout`) and a read through an
untyped function argument can vouch for each other, and so can the same key of two trees named in a shared module
(`algorithm.adv_estimator`; flow's is refused explicitly). The tests below prove the method catches what it is for:
a new field that nothing reads fails it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from pathlib import Path

import pytest

import polyrl
from polyrl.config import set_key
from polyrl.errors import ConfigError

ROOT = Path(polyrl.__file__).resolve().parent
ENTRIES = {  # modules that run each tree's trainer; their import closure reads that tree
    "train": ["trainer/ppo.py", "trainer/async_ppo.py", "trainer/checks.py"],
    "sft": ["trainer/sft.py"],
    "flow": ["trainer/flow_cli.py", "trainer/flow_grpo.py", "trainer/flow_quickstart.py"],
}
DISPATCHER = "cli.py"  # reads keys of every tree; its imports are not followed


def trees() -> dict:
    from polyrl.trainer.config import PPOConfig
    from polyrl.trainer.flow_config import FlowConfig
    from polyrl.trainer.sft import SFTConfig

    return {"train": PPOConfig(), "sft": SFTConfig(), "flow": FlowConfig()}


@dataclasses.dataclass(frozen=True)
class Leaf:
    key: str  # dotted
    cls: str  # the dataclass that declares the field
    groups: tuple[tuple[str, str], ...]  # (parent name, group name) for every group on the path, outermost first

    @property
    def name(self) -> str:
        return self.key.rsplit(".", 1)[-1]

    @property
    def parent(self) -> str:
        return self.groups[-1][1] if self.groups else ""


def leaves(cfg, prefix: str = "", groups: tuple = ()) -> list[Leaf]:
    out = []
    for f in dataclasses.fields(cfg):
        val = getattr(cfg, f.name)
        if dataclasses.is_dataclass(val):
            parent = groups[-1][1] if groups else ""
            out += leaves(val, f"{prefix}{f.name}.", groups + ((parent, f.name),))
        else:
            out.append(Leaf(f"{prefix}{f.name}", type(cfg).__name__, groups))
    return out


# ----------------------------------------------------------------------------------------------- the readers
def _module_path(name: str) -> Path | None:
    rel = name.removeprefix("polyrl").lstrip(".").replace(".", "/")
    for p in (ROOT / rel / "__init__.py", ROOT / f"{rel}.py"):
        if p.is_file():
            return p
    return None


def _imports(path: Path) -> set[Path]:
    pkg = path.relative_to(ROOT.parent).with_suffix("").parts
    pkg = pkg[:-1] if pkg[-1] != "__init__" else pkg[:-1]
    found = set()
    for node in ast.walk(_tree(path)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ((base,) if base else ()))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for n in names:
            if n.startswith("polyrl") and (p := _module_path(n)) is not None:
                found.add(p)
    return found


def readers(tree: str) -> set[Path]:
    todo, seen = [ROOT / e for e in ENTRIES[tree]], set()
    while todo:
        p = todo.pop()
        if p in seen or p == ROOT / DISPATCHER:
            continue
        seen.add(p)
        todo += _imports(p)
    return seen | {ROOT / DISPATCHER}


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


# ----------------------------------------------------------------------------------------------- the reads
class _Reads(ast.NodeVisitor):
    """(hint, name) of every attribute load; the hint is the receiver's last dotted part or `class:<Name>`."""

    def __init__(self, config_classes: set[str]):
        self.config_classes = config_classes
        self.reads: set[tuple[str, str]] = set()
        self.scopes: list[dict[str, ast.AST | str]] = [{}]

    def _chain(self, node, depth: int = 0) -> list[str]:
        if depth > 20:
            return []
        if isinstance(node, ast.Attribute):
            return self._chain(node.value, depth + 1) + [node.attr]
        if isinstance(node, ast.Name):
            for scope in reversed(self.scopes):
                if node.id in scope:
                    v = scope[node.id]
                    return [v] if isinstance(v, str) else self._chain(v, depth + 1)
            return [node.id]
        return []

    def _hint(self, receiver) -> str:
        chain = self._chain(receiver)
        return chain[-1] if chain else ""

    def _bind_function(self, node) -> None:
        scope: dict[str, ast.AST | str] = {}
        args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
        for a in args:
            names = {n.id for n in ast.walk(a.annotation) if isinstance(n, ast.Name)} if a.annotation else set()
            if len(names & self.config_classes) == 1:  # `cfg: FlowConfig`, `custom: CustomRewardConfig | None`
                scope[a.arg] = f"class:{(names & self.config_classes).pop()}"
        for sub in ast.walk(node):  # aliases: `a = cfg.actor`, `a, r = x.actor, x.rollout`
            if isinstance(sub, ast.Assign) and len(sub.targets) == 1:
                t, v = sub.targets[0], sub.value
                if isinstance(t, ast.Name) and isinstance(v, (ast.Attribute, ast.Name)):
                    scope.setdefault(t.id, v)
                elif isinstance(t, ast.Tuple) and isinstance(v, ast.Tuple) and len(t.elts) == len(v.elts):
                    for te, ve in zip(t.elts, v.elts):
                        if isinstance(te, ast.Name) and isinstance(ve, (ast.Attribute, ast.Name)):
                            scope.setdefault(te.id, ve)
        self.scopes.append(scope)

    def visit_FunctionDef(self, node):
        self._bind_function(node)
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        if node.name in self.config_classes:  # field declarations are not reads; methods are, on `self`
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.scopes.append({"self": f"class:{node.name}"})
                    self.visit(item)
                    self.scopes.pop()
            return
        self.generic_visit(node)

    def _keys_named(self, call) -> list[str]:
        return [n.value for n in ast.walk(call) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                and "." in n.value and " " not in n.value]

    def visit_Attribute(self, node):
        if isinstance(node.ctx, ast.Load):
            self.reads.add((self._hint(node.value), node.attr))
        self.generic_visit(node)

    def visit_Call(self, node):
        for key in self._keys_named(node):  # `to_dtype(cfg.dtype, "actor_rollout_ref.rollout.dtype")`
            leaf = key.rsplit(".", 1)[-1]
            if any(isinstance(a, ast.Attribute) and a.attr == leaf and isinstance(a.ctx, ast.Load)
                   for a in ast.walk(node)):
                self.reads.add((f"key:{key}", leaf))
        if isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            self.reads.add((self._hint(node.args[0]), node.args[1].value))
        self.generic_visit(node)


def reads_in(paths, config_classes: set[str]) -> set[tuple[str, str, frozenset]]:
    """(hint, name, config classes the module names) of every read in `paths`."""
    out = set()
    for p in paths:
        v = _Reads(config_classes)
        v.visit(_tree(p))
        mentions = frozenset(config_classes & _identifiers(p))
        out |= {(hint, name, mentions) for hint, name in v.reads}
    return out


def _identifiers(path: Path) -> set[str]:
    tree = _tree(path)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
        {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}


def unread_keys(cfg, reads) -> list[str]:
    """The leaves of `cfg` that `reads` does not read (the module docstring's step 4)."""
    ls = leaves(cfg)
    classes_of_name: dict[str, set[str]] = {}
    for leaf in ls:
        classes_of_name.setdefault(leaf.name, set()).add(leaf.cls)
    group_classes: dict[str, set[str]] = {}  # group name -> classes of the groups with that name
    _collect_groups(cfg, group_classes)
    known = set(group_classes) | {f"class:{c}" for cs in group_classes.values() for c in cs}
    by_name: dict[str, list[tuple[str, frozenset]]] = {}
    for hint, name, mentions in reads:
        by_name.setdefault(name, []).append((hint, mentions))

    def read_on(name: str, parent: str, classes: set[str], unique: bool, key: str = "") -> bool:
        for hint, mentions in by_name.get(name, ()):
            if key and hint == f"key:{key}":
                return True
            if hint == parent or hint in {f"class:{c}" for c in classes}:
                return True
            untyped = hint not in known and not hint.startswith("key:")  # `cfg.x`, `c.enable`
            if untyped and (unique or classes & mentions):
                return True
        return False

    def group_read(parent: str, group: str) -> bool:
        if not parent:  # a top-level group: read on the tree object, whatever it is called
            return bool(by_name.get(group))
        return read_on(group, parent, group_classes[parent], unique=len(group_classes[group]) == 1)

    return [leaf.key for leaf in ls
            if not (read_on(leaf.name, leaf.parent, {leaf.cls}, len(classes_of_name[leaf.name]) == 1, leaf.key)
                    and all(group_read(p, g) for p, g in leaf.groups))]


def _collect_groups(cfg, out: dict[str, set[str]]) -> None:
    for f in dataclasses.fields(cfg):
        val = getattr(cfg, f.name)
        if dataclasses.is_dataclass(val):
            out.setdefault(f.name, set()).add(type(val).__name__)
            _collect_groups(val, out)


def config_classes(cfg, out: set[str] | None = None) -> set[str]:
    out = set() if out is None else out
    out.add(type(cfg).__name__)
    for f in dataclasses.fields(cfg):
        if dataclasses.is_dataclass(v := getattr(cfg, f.name)):
            config_classes(v, out)
    return out


def unread(tree: str) -> list[str]:
    cfg = trees()[tree]
    return unread_keys(cfg, reads_in(readers(tree), config_classes(cfg)))


@pytest.mark.parametrize("tree", ["train", "sft", "flow"])
def test_every_key_is_read_or_refused(tree):
    from polyrl.trainer.key_checks import REFUSED_KEYS

    missing = [k for k in unread(tree) if k not in REFUSED_KEYS.get(tree, {})]
    assert not missing, (f"`polyrl keys {tree}` accepts keys that nothing reads: {missing}. Read each one where it "
                         "takes effect, or refuse values other than its default "
                         "(polyrl.trainer.key_checks.REFUSED_KEYS).")


def _check(tree: str, cfg) -> None:
    """The checks each trainer runs on its tree before anything is loaded."""
    if tree == "train":
        from polyrl.trainer.checks import check_supported
        from polyrl.trainer.ppo import resolve_defaults

        resolve_defaults(cfg)
        check_supported(cfg)
    elif tree == "flow":
        from polyrl.trainer.checks import check_flow_supported

        check_flow_supported(cfg)
    else:
        from polyrl.trainer.key_checks import refuse_unread

        refuse_unread(cfg, "sft")


def _set_non_default(cfg, key: str, value) -> None:
    """Set `key` to a value of its type other than `value` (its default)."""
    candidates = [not value] if isinstance(value, bool) else [value + 7] if isinstance(value, (int, float)) else []
    for candidate in candidates + [7, "something_else", ["x"], {"x": 1}, True]:  # True: an auto (None) switch
        if candidate == value:
            continue
        try:
            return set_key(cfg, key, candidate)
        except ConfigError:
            continue
    raise AssertionError(f"no non-default value fits {key}")


@pytest.mark.parametrize("tree", ["train", "sft", "flow"])
def test_refused_keys_are_refused(tree):
    from polyrl.trainer.key_checks import REFUSED_KEYS, get_key

    _check(tree, trees()[tree])  # the defaults pass
    for key in REFUSED_KEYS[tree]:
        cfg = trees()[tree]
        _set_non_default(cfg, key, get_key(cfg, key))
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            _check(tree, cfg)


def test_a_new_field_nobody_reads_fails_the_walk(monkeypatch):
    """The method catches what it is for: a field added to a config class and read nowhere (a synthetic class
    mounted in the tree), while the same field read by a module (an AST read on its group) passes."""

    @dataclasses.dataclass
    class Knobs:
        fresh_knob: int = 3
        """A new key."""

    @dataclasses.dataclass
    class Other:
        fresh_knob: int = 4
        """The same name in another group."""

    @dataclasses.dataclass
    class Tree:
        actor: Knobs = dataclasses.field(default_factory=Knobs)
        """A group."""
        critic: Other = dataclasses.field(default_factory=Other)
        """Another group."""

    def reads(src: str) -> set:
        v = _Reads({"Tree", "Knobs", "Other"})
        v.visit(ast.parse(src))
        return {(h, n, frozenset()) for h, n in v.reads}

    cfg = Tree()
    assert unread_keys(cfg, set()) == ["actor.fresh_knob", "critic.fresh_knob"]
    both = "def f(cfg):\n    a = cfg.actor\n    return a.fresh_knob + cfg.critic.fresh_knob\n"
    assert unread_keys(cfg, reads(both)) == []
    # read on the other group only: the actor's key stays unread
    assert unread_keys(cfg, reads("def f(cfg):\n    return cfg.actor, cfg.critic.fresh_knob\n")) == [
        "actor.fresh_knob"]


def test_a_new_field_in_a_real_config_class_fails_the_walk(monkeypatch):
    """A field added to the real `FSDPConfig` (shared by the actor, the reference and the critic) is unread in
    every tree that mounts it."""
    from polyrl.learner import config as learner_config

    fields = [(f.name, f.type, f) for f in dataclasses.fields(learner_config.FSDPConfig)]
    patched = dataclasses.make_dataclass("FSDPConfig", [*fields, ("zz_unread_knob", int, dataclasses.field(
        default=0))], namespace={"cpu_offload": learner_config.FSDPConfig.cpu_offload})
    monkeypatch.setattr(learner_config, "FSDPConfig", patched)
    from polyrl.trainer.flow_config import FlowActorConfig

    cfg = trees()["flow"]
    cfg.actor_rollout_ref.actor = FlowActorConfig(fsdp_config=patched())
    missing = unread_keys(cfg, reads_in(readers("flow"), config_classes(cfg)))
    assert "actor_rollout_ref.actor.fsdp_config.zz_unread_knob" in missing


def test_model_dtype_is_the_model_dtype():
    """verl's fsdp_config.model_dtype: a non-default value sets model.dtype; a disagreement is refused."""
    from polyrl.trainer.checks import resolve_model_dtypes

    cfg = trees()["train"]
    set_key(cfg, "actor_rollout_ref.actor.fsdp_config.model_dtype", "bf16")
    resolve_model_dtypes(cfg)
    assert cfg.actor_rollout_ref.model.dtype == "bfloat16"
    set_key(cfg, "actor_rollout_ref.model.dtype", "float16")
    with pytest.raises(ConfigError, match="disagree"):
        resolve_model_dtypes(cfg)
    cfg = trees()["train"]
    set_key(cfg, "actor_rollout_ref.ref.fsdp_config.model_dtype", "bf16")  # the reference copies the actor (fp32)
    with pytest.raises(ConfigError, match="ref.fsdp_config.model_dtype"):
        resolve_model_dtypes(cfg)


@pytest.mark.parametrize("key, value, ok", [
    ("actor_rollout_ref.actor.checkpoint.save_contents", ["model", "optimizer", "extra", "hf_model"], True),
    ("actor_rollout_ref.actor.checkpoint.save_contents", ["model"], False),
    ("actor_rollout_ref.actor.checkpoint.load_contents", ["model", "optimizer", "extra", "hf_model"], False),
    ("critic.checkpoint.save_contents", ["model", "optimizer", "extra", "hf_model"], False),  # no critic export
])
def test_checkpoint_contents_are_honoured_or_refused(key, value, ok):
    from polyrl.trainer.checks import check_supported

    cfg = trees()["train"]
    set_key(cfg, key, value)
    if ok:
        check_supported(cfg)
    else:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            check_supported(cfg)


def test_deprecated_global_micro_batch_is_divided_over_data_shards():
    """The trainer and its checks derive per-GPU sizes with the same function (ppo.py used to take verl's deprecated
    global `ppo_micro_batch_size` as a per-GPU size)."""
    from polyrl.learner.config import micro_batch_per_gpu, mini_batch_per_gpu

    assert micro_batch_per_gpu(None, 8, 2) == 4
    assert micro_batch_per_gpu(3, None, 2) == 3
    assert micro_batch_per_gpu(None, None, 2) is None
    assert mini_batch_per_gpu(4, 8, 2) == 16


if __name__ == "__main__":
    for t in ("train", "sft", "flow"):
        print(t, unread(t))
