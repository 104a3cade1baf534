"""Imports go downward only (DESIGN.md section 5), checked on the source with `ast`.

Every import statement of every module under pagedllm/ counts: at module level, inside
functions, under `if TYPE_CHECKING:` and in try/except alike (a lazy or type-only import
is still a dependency a reader has to follow). Registries that import by name string
(`importlib.import_module`) are not seen; they stay inside their own package by design.

The top-level modules and subpackages of pagedllm/, by rank (higher imports lower):

  8  entrypoints   the CLI (which also runs `pagedllm bench`), chat, the OpenAI server
  7  bench         benchmarks: drive the public API (LLM) or a running server
  6  pagedllm      the package __init__: the public API re-exported from engine/ and leaves
  5  engine        LLM, LLMEngine, engine core (schedule -> execute -> update), processors
  4  executor      runs the model runner in-process or in worker processes (mp)
  3  worker        ModelRunner, InputBatch, KV sizing, model loading, torch.compile
  2  models, attention, loader, sample, lora, multimodal
                   one rank: models use attention layers; attention and loader never
                   import models; lora (adapters on disk, and on a linear) packs its
                   weights with the models' linear helpers; multimodal (images in
                   prompts: decoding, the model's image processor)
  1  nn, kernels, distributed
                   torch building blocks shared by attention/ and models/ (nn.Module base);
                   kernels/cpu: the native CPU kernels (build, CPU features, typed ops);
                   distributed: tensor-parallel groups and collectives the layers call
  0  core          scheduler and KV block accounting: pure Python (tests/core/test_no_torch.py)
  -1 config, errors, json_limits, sampling_params, pooling_params, lora_request, request,
     outputs, metrics, reasoning, mm_inputs, inputs, logits_process (the custom logits
     processors' base class)
                   leaf modules, importing only each other: core/ and everything above use
                   them (metrics reads the engine core's messages through Protocols)

An import may only go to the same or a lower rank. `test_no_import_cycles` adds that no
two modules import each other, directly or through others (also within one package).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pagedllm

PACKAGE_DIR = Path(pagedllm.__file__).resolve().parent
ROOT = "pagedllm"  # the package __init__ itself ("from pagedllm import LLM")

RANKS: dict[str, int] = {
    "entrypoints": 8,
    "bench": 7,
    ROOT: 6,
    "engine": 5,
    "executor": 4,
    "worker": 3,
    "models": 2, "attention": 2, "loader": 2, "sample": 2, "lora": 2, "multimodal": 2,
    "nn": 1, "kernels": 1, "distributed": 1,
    "core": 0,
    "config": -1, "errors": -1, "json_limits": -1, "sampling_params": -1, "pooling_params": -1,
    "lora_request": -1, "reasoning": -1, "mm_inputs": -1,
    "request": -1, "outputs": -1, "metrics": -1, "inputs": -1, "logits_process": -1,
    "qualname": -1, "log_config": -1,
}
NEVER_IMPORT_MODELS = ("attention", "loader")

# (importer, imported) module pairs that break the layering today, each with why it is
# not fixed yet. The test fails when one disappears, so fixing it means deleting it here.
KNOWN_VIOLATIONS: dict[tuple[str, str], str] = {}


def _module_names() -> dict[str, Path]:
    """Dotted name -> file of every module under pagedllm/ (packages by __init__.py)."""
    names = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _resolve(name: str, modules: dict[str, Path]) -> str:
    """The module an imported dotted name lives in (`pagedllm.x.Cls` -> `pagedllm.x`)."""
    while name not in modules and "." in name:
        name = name.rpartition(".")[0]
    return name


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
              modules: dict[str, Path]) -> list[str]:
    """pagedllm modules one import statement of `module` names (resolved, relative too)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            # Level 1 is the importer's own package (the module itself for an __init__).
            package = module.split(".") if is_package else module.split(".")[:-1]
            package = package[:len(package) - (node.level - 1)]
            base = ".".join(package + ([node.module] if node.module else []))
        # `from pkg import sub` names the submodule when there is one.
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                 for alias in node.names]
    return [_resolve(n, modules) for n in names if n.split(".")[0] == ROOT]


def import_graph() -> dict[str, list[tuple[str, int]]]:
    """Module -> [(imported pagedllm module, line)], every import statement included."""
    modules = _module_names()
    graph: dict[str, list[tuple[str, int]]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        edges = graph.setdefault(module, [])
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges += [(target, node.lineno)
                          for target in _imported(node, module, is_package, modules)
                          if target != module]
    return graph


def _top(module: str) -> str:
    """The rank-table entry of a module: `pagedllm.engine.llm` -> `engine`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def layering_violations(graph: dict[str, list[tuple[str, int]]]) -> set[tuple[str, str, int]]:
    """(importer, imported, line) of every import that goes up a rank or into models/."""
    bad = set()
    for module, edges in graph.items():
        src = _top(module)
        for target, line in edges:
            dst = _top(target)
            if RANKS[dst] > RANKS[src] or (src in NEVER_IMPORT_MODELS and dst == "models"):
                bad.add((module, target, line))
    return bad


def import_cycles(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    succ = {m: sorted({t for t, _ in edges}) for m, edges in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in succ:
        if root in index:
            continue
        work = [(root, iter(succ[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(succ[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
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
                    cycles.append(sorted(component))
    return cycles


def _why(src: str, dst: str) -> str:
    a, b = _top(src), _top(dst)
    if RANKS[b] <= RANKS[a]:
        return f"{a} never imports models"
    return f"{a} (rank {RANKS[a]}) must not import {b} (rank {RANKS[b]})"


def test_every_top_level_module_has_a_rank():
    tops = {_top(m) for m in _module_names()}
    unranked = sorted(tops - set(RANKS))
    assert not unranked, (f"top-level modules missing from RANKS: {unranked}; place each "
                          f"by what it imports and what imports it (module docstring)")


def test_imports_go_downward_only():
    bad = layering_violations(import_graph())
    known = {(src, dst) for src, dst, _ in bad if (src, dst) in KNOWN_VIOLATIONS}
    new = sorted(f"{src} -> {dst} (line {line}): {_why(src, dst)}"
                 for src, dst, line in bad if (src, dst) not in KNOWN_VIOLATIONS)
    assert not new, "imports against the layering:\n" + "\n".join(new)
    stale = sorted(set(KNOWN_VIOLATIONS) - known)
    assert not stale, f"fixed, so delete from KNOWN_VIOLATIONS: {stale}"


def test_no_import_cycles():
    graph = import_graph()
    for src, dst in KNOWN_VIOLATIONS:  # the known upward edge is what closes its cycle
        graph[src] = [(t, line) for t, line in graph[src] if t != dst]
    cycles = import_cycles(graph)
    assert not cycles, "modules that import each other (move the shared piece down):\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_function_level_and_type_checking_imports(tmp_path):
    # Guards the checker itself: all three kinds of import statement are edges.
    modules = {"pagedllm.core.x": tmp_path / "x.py", "pagedllm.engine.llm": tmp_path,
               "pagedllm.loader": tmp_path, "pagedllm.models.llama": tmp_path}
    source = ("from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from pagedllm.engine.llm import LLM\n"
              "def f():\n    import pagedllm.models.llama\n"
              "    from .. import loader\n")
    found = [t for node in ast.walk(ast.parse(source))
             if isinstance(node, (ast.Import, ast.ImportFrom))
             for t in _imported(node, "pagedllm.core.x", False, modules)]
    assert sorted(found) == ["pagedllm.engine.llm", "pagedllm.loader", "pagedllm.models.llama"]
