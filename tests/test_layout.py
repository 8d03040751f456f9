"""The code's layout: imports run one way down the layers the README lists, and down training/'s floors, with no
cycle."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

# Lower layers never import higher ones (README, "How the code is laid out").
LAYERS = [
    {"common", "model", "model_size"},
    {"data"},
    {"hf_interop"},
    {"runtime"},
    {"training"},
    {"evals"},
    {"launch"},
    {"train_gpt2", "sample", "eval_lm", "export_hf", "consolidate_checkpoint", "plot_log", "compare_runs", "ladder",
     "scaling_ladder", "prep", "scripts", "benchmarks"},
]
LAYER_OF = {name: depth for depth, names in enumerate(LAYERS) for name in names}
# Inside training/, its sub-packages, bottom to top: a floor imports only the floors below it (README).
FLOORS = ["distributed", "optim", "checkpoint", "observe", "run"]
FLOOR_OF = {name: depth for depth, name in enumerate(FLOORS)}


def project_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every Python file of the project (not tests)."""
    modules = {}
    for path in REPO.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[0] in LAYER_OF:
            modules[".".join(p for p in parts if p != "__init__")] = path
    return modules


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules a file imports at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        found |= {name for name in names if name in modules}
    return found


def test_imports_run_one_way_down_the_layers():
    modules = project_modules()
    assert {"model", "training.run.step", "training.run.lockstep", "evals.periodic", "hf_interop.convert"} <= modules.keys()
    upward = []
    for name, path in modules.items():
        for imported in imports_of(path, modules):
            if LAYER_OF[imported.split(".")[0]] > LAYER_OF[name.split(".")[0]]:
                upward.append(f"{name} imports {imported}")
    assert upward == []


def floor_of(module: str) -> int | None:
    """The floor of a module of training/ (None: any other module, or the training package itself)."""
    parts = module.split(".")
    return FLOOR_OF[parts[1]] if parts[0] == "training" and len(parts) > 1 else None


def test_inside_training_imports_run_down_the_floors():
    """checkpoint never imports the run, observe never the configuration, distributed nothing of training but
    itself."""
    modules = project_modules()
    placed = {name.split(".")[1] for name in modules if name.startswith("training.")}
    assert placed == set(FLOORS), "a module of training/ outside the floors, or a floor that is gone"
    upward = []
    for name, path in modules.items():
        floor = floor_of(name)
        for imported in imports_of(path, modules):
            if floor is not None and (floor_of(imported) or 0) > floor:
                upward.append(f"{name} imports {imported}")
    assert upward == []


def test_the_kernels_import_nothing_of_the_runtime_but_themselves():
    """runtime/kernels/ is the runtime's floor: the Triton kernels and their torch fallbacks, which the runtime
    chooses from (runtime/runtime.py) and the model's loss heads call."""
    modules = project_modules()
    kernels = {name for name in modules if name.startswith("runtime.kernels")}
    assert {"runtime.kernels.cross_entropy", "runtime.kernels.add_layer_norm"} <= kernels
    upward = [f"{name} imports {imported}" for name in kernels for imported in imports_of(modules[name], modules)
              if imported.startswith("runtime") and not imported.startswith("runtime.kernels")]
    assert upward == []


def test_the_layers_keep_to_themselves():
    """model.py is pure (its torch-free arithmetic, model_size.py, apart), common/errors.py and common/atomic_file.py
    stand alone, and the module graph has no cycle."""
    modules = project_modules()
    graph = {name: imports_of(path, modules) - {name} for name, path in modules.items()}
    assert graph["model"] == {"model_size"}, graph["model"]
    for name in ("model_size", "common.errors", "common.atomic_file"):
        assert graph[name] == set(), (name, graph[name])
    state: dict[str, str] = {}  # depth-first search: "open" while on the stack, "done" after

    def visit(name: str, trail: list[str]) -> None:
        if state.get(name) == "open":
            raise AssertionError("import cycle: " + " -> ".join(trail[trail.index(name):] + [name]))
        if state.get(name) == "done":
            return
        state[name] = "open"
        for imported in graph[name]:
            visit(imported, trail + [name])
        state[name] = "done"

    for name in graph:
        visit(name, [])
