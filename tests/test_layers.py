"""The import graph of the installed package: every import goes to the same layer or one below, and
no module imports itself back through others. docs/architecture.md quotes the picture this file
draws and the GRPO step from the source; both are checked here so that the page stays true.

    python -m tests.test_layers --write     # redraw docs/architecture.md's generated blocks

The graph is read from the sources with ``ast`` (nothing is imported), laid out as installed:
``rlcore/`` is ``rlcore``, ``algorithms/`` is ``rlcore.algorithms``, ``loops/`` is
``rlcore.loops``. Every import counts: at the top of a module, inside a function (a lazy import
is still a dependency), under ``TYPE_CHECKING``, and a module named by a string constant in a
call (``importlib.import_module("rlcore...")``, ``__import__``, a forkserver preload list).
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"rlcore": ROOT / "rlcore", "rlcore.algorithms": ROOT / "algorithms", "rlcore.loops": ROOT / "loops"}
DOC = ROOT / "docs" / "architecture.md"

# bottom to top; a module's layer is the first whose test matches its dotted name
LAYERS: list[tuple[str, str]] = [
    ("core", "tensors in, tensors out: keys, checks, log-probs, KL, advantages, kernels"),
    ("algorithms", "the losses and their presets, on TensorDict batches"),
    ("dist", "torch.distributed: process groups, DDP / FSDP2, collectives"),
    ("loops", "the loop's pieces: models, data, generation, scoring, update, fold, checkpoints"),
    ("recipes", "one module per trainer, and the table of them"),
    ("orchestration", "asynchronous generation, Ray placement: they run recipes"),
    ("app", "the rlcore command and the demo"),
]
APP = {"rlcore.loops.cli", "rlcore.loops.demo", "rlcore.loops.__main__"}


def layer_of(module: str) -> str:
    if module in APP:
        return "app"
    for prefix, layer in (("rlcore.loops.scale", "orchestration"), ("rlcore.loops.recipes", "recipes"),
                          ("rlcore.loops.dist", "dist"), ("rlcore.loops", "loops"), ("rlcore.algorithms", "algorithms")):
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return "core"


def _modules(sources: dict[str, Path]) -> dict[str, Path]:
    found = {}
    for package, folder in sources.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            name = ".".join([package, *parts])
            if package == "rlcore" and parts[:1] in (["algorithms"], ["loops"]):
                continue  # never the case on disk; guards a stray copy
            found[name] = path
    return found


def import_graph(sources: dict[str, Path] = SOURCES) -> dict[str, set[str]]:
    """``module -> modules of the same tree it imports`` (``from pkg import sub`` counts as ``pkg.sub``)."""
    modules = _modules(sources)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = (".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
                        if node.level else node.module or "")
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
            elif isinstance(node, ast.Call):  # importlib.import_module("rlcore..."), __import__, preload lists
                targets.update(_named_modules([*node.args, *(k.value for k in node.keywords)], modules))
        graph[name] = {_owner(t, modules) for t in targets if _owner(t, modules)} - {name}
    return graph


def _named_modules(nodes: list[ast.expr], modules: dict[str, Path]) -> set[str]:
    """The module names spelled out as string constants among a call's arguments (inside lists and
    tuples too): a module imported by name is still a dependency."""
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules:
            found.add(node.value)
        elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            found |= _named_modules(list(node.elts), modules)
    return found


def _owner(target: str, modules: dict[str, Path]) -> str:
    """The module ``target`` names, or its nearest package that is one of ``modules`` ("" if none)."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    rank = {name: i for i, (name, _) in enumerate(LAYERS)}
    return sorted((a, b) for a, targets in graph.items() for b in targets if rank[layer_of(b)] > rank[layer_of(a)])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            nxt = next((t for t in targets if t not in index or t in on_stack), None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                else:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def picture(graph: dict[str, set[str]]) -> str:
    """The layers, top to bottom, each with its modules and how many imports it makes into each layer below."""
    members: dict[str, list[str]] = {name: [] for name, _ in LAYERS}
    for module in sorted(graph):
        members[layer_of(module)].append(module)
    counts: dict[tuple[str, str], int] = {}
    for a, targets in graph.items():
        for b in targets:
            if layer_of(a) != layer_of(b):
                counts[layer_of(a), layer_of(b)] = counts.get((layer_of(a), layer_of(b)), 0) + 1
    lines = []
    for i, (name, what) in enumerate(reversed(LAYERS)):
        short = [m.removeprefix("rlcore.").removeprefix("loops.").removeprefix("recipes.").removeprefix("scale.")
                 .removeprefix("dist.") for m in members[name]]
        below = ", ".join(f"{b} {n}" for b in reversed([x for x, _ in LAYERS]) if (n := counts.get((name, b))))
        lines.append(f"{name:<14} {what}")
        lines += [f"{'':<14} | {chunk}" for chunk in _wrap(short, 84)]
        if below:
            lines.append(f"{'':<14} imports into: {below}")
        if i < len(LAYERS) - 1:
            lines.append(f"{'':<14} v")
    return "\n".join(lines)


def _wrap(words: list[str], width: int) -> list[str]:
    out, line = [], ""
    for word in words:
        if line and len(line) + 2 + len(word) > width:
            out.append(line + ",")
            line = word
        else:
            line = f"{line}, {word}" if line else word
    return [*out, line] if line else out


def grpo_step_source() -> str:
    """The GRPO step as it reads in loops/recipes/grpo.py: ``step``, ``collect_groups``, the loss's binding
    ``grpo_loss_fn``, ``learn`` and its ``update_policy``, in the file's order."""
    tree = ast.parse((SOURCES["rlcore.loops"] / "recipes" / "grpo.py").read_text(encoding="utf-8"))
    text = (SOURCES["rlcore.loops"] / "recipes" / "grpo.py").read_text(encoding="utf-8").splitlines()
    parts = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in ("step", "collect_groups", "grpo_loss_fn", "learn", "update_policy"):
            parts.append("\n".join(text[node.lineno - 1:node.end_lineno]))
    return "\n\n\n".join(parts)


def config_sections() -> str:
    """Each config section with the fields it declares, then each recipe's ``Config`` as the sections
    it is made of (its direct bases) and the defaults it changes (``loops.settings``)."""
    import dataclasses

    from rlcore.loops.recipes import RECIPES
    from rlcore.loops.settings import declared

    configs = {name: recipe.config for name, recipe in RECIPES.items()}
    owners: dict[type, list[str]] = {}
    for cls in configs.values():
        for field, owner in declared(cls).items():
            owners.setdefault(owner, [])
            if field not in owners[owner]:
                owners[owner].append(field)
    lines = []
    for owner in sorted(owners, key=lambda c: (c.__module__ != "rlcore.loops.settings", c.__module__, c.__qualname__)):
        ordered = [f.name for f in dataclasses.fields(owner) if f.name in owners[owner]]
        lines += [f"{owner.__qualname__:<24} {chunk}" if i == 0 else f"{'':<24} {chunk}"
                  for i, chunk in enumerate(_wrap(ordered, 84))]
    lines.append("")
    for name, cls in configs.items():
        bases = [b.__qualname__ if b.__qualname__ != "Config" else f"{b.__module__.rsplit('.', 1)[-1]}.Config"
                 for b in cls.__bases__]
        lines += [f"{name if i == 0 else '':<12} {chunk}" for i, chunk in enumerate(_wrap(bases, 96))]
        changed = [f"{k}={v!r}" for k, v in cls.__dict__.get("__defaults__", {}).items()]
        lines += [f"{'':<12} {'defaults:' if i == 0 else '':<9} {chunk}" for i, chunk in enumerate(_wrap(changed, 86))]
    return "\n".join(lines)


BLOCKS = {"layers": lambda: picture(import_graph()), "grpo-step": grpo_step_source, "sections": config_sections}


def generated(name: str) -> str:
    fence = "python" if name == "grpo-step" else "text"
    return f"<!-- {name}: generated by tests/test_layers.py -->\n```{fence}\n{BLOCKS[name]()}\n```\n<!-- /{name} -->"


def _block(text: str, name: str) -> re.Match | None:
    return re.search(rf"<!-- {re.escape(name)}: generated by tests/test_layers.py -->\n.*?<!-- /{re.escape(name)} -->",
                     text, flags=re.DOTALL)


def write() -> None:
    text = DOC.read_text(encoding="utf-8")
    for name in BLOCKS:
        found = _block(text, name)
        if found is None:
            raise SystemExit(f"{DOC}: no block {name!r} to redraw")
        text = text[:found.start()] + generated(name) + text[found.end():]
    DOC.write_text(text, encoding="utf-8")


# --- tests -----------------------------------------------------------------------------------------
def test_no_import_goes_upward():
    up = upward_imports(import_graph())
    assert not up, "imports into a higher layer (docs/architecture.md):\n" + "\n".join(
        f"  {a} ({layer_of(a)}) -> {b} ({layer_of(b)})" for a, b in up)


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_benchmarks_have_no_import_cycles():
    bench = ROOT / "benchmarks"
    graph = {p.stem: set() for p in bench.glob("*.py")}
    for path in bench.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            graph[path.stem] |= {n for n in names if n in graph and n != path.stem}
    assert cycles(graph) == []


def test_every_module_has_a_layer_and_every_layer_a_module():
    graph = import_graph()
    assert {layer_of(m) for m in graph} == {name for name, _ in LAYERS}
    assert "rlcore.loops.recipes.grpo" in graph and "rlcore.loops.dist.sync" in graph


def test_the_graph_sees_lazy_relative_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "loops"
    (pkg / "scale").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "scale" / "__init__.py").write_text("")
    (pkg / "scale" / "runner.py").write_text("")
    (pkg / "piece.py").write_text(inspect.cleandoc("""
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from .other import X
        def f():
            from rlcore.loops.scale import runner
        def g():
            importlib.import_module("rlcore.loops.scale")
            ctx.set_forkserver_preload(["rlcore.loops.scale.runner"])
    """))
    (pkg / "other.py").write_text("from . import piece\n")
    graph = import_graph({"rlcore.loops": pkg})
    assert graph["rlcore.loops.piece"] == {"rlcore.loops.other", "rlcore.loops.scale", "rlcore.loops.scale.runner"}
    assert upward_imports(graph) == [("rlcore.loops.piece", "rlcore.loops.scale"),
                                     ("rlcore.loops.piece", "rlcore.loops.scale.runner")]
    assert cycles(graph) == [["rlcore.loops.other", "rlcore.loops.piece"]]


def test_the_architecture_page_shows_the_graph_and_the_step_as_they_are():
    text = DOC.read_text(encoding="utf-8")
    for name in BLOCKS:
        found = _block(text, name)
        assert found is not None, f"{DOC.name}: the generated block {name!r} is missing"
        assert found.group(0) == generated(name), (
            f"{DOC.name}: the {name!r} block is stale; redraw it with `python -m tests.test_layers --write`")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write()
    else:
        print(picture(import_graph()))
