"""The package's shape, read from its source with ``ast`` (nothing of the package is imported to judge it): no
import cycle, no import from a lower layer to a higher one (the map in docs/design.md), few imports inside
functions and each with its reason, and no registered kernel, stage or task name compared as a string outside
the module that defines it."""

from __future__ import annotations

import ast
import os
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "hf_kernel_attn"

# docs/design.md, "The package map": a module may import its own layer's and lower layers' modules
LAYERS = {
    0: {"<root>", "_registration", "registry", "fileio", "events", "model_paths", "checkpoint_files", "data",
        "kernel_args", "configfile", "catalog"},
    1: {"kernels"},
    2: {"config", "integration"},
    3: {"evaluation", "speed", "testing"},
    4: {"training"},
    5: {"leaderboard"},
    6: {"similarity"},
    7: {"commands"},
    8: {"cli"},
}
LAYER_OF = {part: level for level, parts in LAYERS.items() for part in parts}
MAX_FUNCTION_IMPORTS = 15


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The package modules an import statement loads."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in MODULES}
    if node.level:
        base = module.split(".")
        if MODULES[module].name != "__init__.py":
            base = base[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    found = set()
    for alias in node.names:
        if f"{source}.{alias.name}" in MODULES:
            found.add(f"{source}.{alias.name}")
        elif source in MODULES:
            found.add(source)
    return found


def _imports() -> tuple[dict[str, set[str]], list[tuple[str, int, str]]]:
    """Module-level imports (outside ``if TYPE_CHECKING``) per module, and every package import inside a
    function (module, line, source line)."""
    graph: dict[str, set[str]] = defaultdict(set)
    in_functions = []
    for module, path in MODULES.items():
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
        lines = text.splitlines()
        type_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                     and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(f)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in type_only:
                continue
            targets = _targets(module, node) - {module}
            if not targets:
                continue
            if id(node) in nested:
                in_functions.append((module, node.lineno, lines[node.lineno - 1]))
            else:
                graph[module] |= targets
    return graph, in_functions


GRAPH, IN_FUNCTIONS = _imports()


def _layer(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "<root>"
    assert top in LAYER_OF, f"{module}: its folder {top!r} has no layer in docs/design.md's package map"
    return LAYER_OF[top]


def test_the_layout_reader_sees_the_package():
    """The reader itself: it finds the modules and known imports (so an empty graph cannot pass)."""
    assert "hf_kernel_attn.training.trainer" in MODULES and "hf_kernel_attn.kernels" in MODULES
    assert "hf_kernel_attn.training.model_setup" in GRAPH["hf_kernel_attn.training.trainer"]
    assert "hf_kernel_attn.registry" in GRAPH["hf_kernel_attn.kernels.registry"]


def test_no_import_cycle():
    """Tarjan's strongly connected components over the module-level imports: every component is one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
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
                cycles.append(sorted(component))

    for module in sorted(MODULES):
        if module not in index:
            visit(module)
    assert not cycles, f"import cycles: {cycles}"


def test_no_import_from_a_lower_layer_to_a_higher_one():
    upward = sorted(f"{a} -> {b}" for a, targets in GRAPH.items() for b in targets if _layer(b) > _layer(a))
    assert not upward, "imports against the package map (docs/design.md):\n" + "\n".join(upward)


def test_imports_inside_functions_are_few_and_say_why():
    assert len(IN_FUNCTIONS) <= MAX_FUNCTION_IMPORTS, IN_FUNCTIONS
    silent = [f"{m}:{line}: {text.strip()}" for m, line, text in IN_FUNCTIONS if "#" not in text]
    assert not silent, "a package import inside a function needs its reason on the line:\n" + "\n".join(silent)


def _registered_names() -> dict[str, str]:
    """Every built-in kernel, training stage, training task and evaluation task name -> the module (folder) that
    defines it, read from the registration decorators and registry calls in the source."""
    import hf_kernel_attn.evaluation.tasks  # noqa: F401  (registers the evaluation tasks)
    from hf_kernel_attn.evaluation.long_context.base import TASKS as LONG_CONTEXT
    from hf_kernel_attn.evaluation.task import EVAL_TASKS
    from hf_kernel_attn.kernels import KERNELS
    from hf_kernel_attn.training.stages import STAGE_TYPES
    from hf_kernel_attn.training.tasks import TASK_TYPES

    owners = {}
    for registry, owner in ((KERNELS, "hf_kernel_attn.kernels"), (STAGE_TYPES, "hf_kernel_attn.training.stages"),
                            (TASK_TYPES, "hf_kernel_attn.training.tasks"),
                            (LONG_CONTEXT, "hf_kernel_attn.evaluation.long_context"),
                            (EVAL_TASKS, "hf_kernel_attn.evaluation")):
        for name in registry:
            owners.setdefault(name, owner)
    return owners


def test_no_registered_name_is_compared_as_a_string_outside_its_owner():
    owners = _registered_names()
    assert {"softmax", "hedgehog", "transfer", "causal_lm", "passkey", "wikitext2"} <= set(owners)
    found = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Compare):
                continue
            for operand in [node.left, *node.comparators]:
                values = [operand] if isinstance(operand, ast.Constant) else (
                    list(operand.elts) if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [])
                for value in values:
                    if isinstance(value, ast.Constant) and value.value in owners \
                            and not module.startswith(owners[value.value]):
                        found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    # other namespaces that share a word: `cosine` names a learning-rate schedule, `full` a projection mode
    other = ("hf_kernel_attn.training.schedules:", "hf_kernel_attn.kernels.projection:")
    found = [f for f in found if not f.startswith(other)]
    assert not found, "names compared as strings:\n" + "\n".join(found)


@pytest.mark.parametrize("module", ["hf_kernel_attn.cli", "hf_kernel_attn.kernel_args", "hf_kernel_attn.configfile",
                                    "hf_kernel_attn.fileio", "hf_kernel_attn.events", "hf_kernel_attn.registry"])
def test_the_ground_floor_and_the_cli_import_no_heavy_module_at_module_level(module):
    """What the CLI parses with must not pull torch in (module-level imports only, transitively)."""
    heavy = {"torch", "transformers", "lm_eval", "matplotlib", "accelerate", "peft"}
    seen, todo, pulled = set(), [module], set()
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        tree = ast.parse(MODULES[m].read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                pulled |= {n.split(".")[0] for n in names if node.__class__ is ast.Import or not node.level} & heavy
                todo += sorted(_targets(m, node) - seen)
    assert not pulled, f"{module} imports {sorted(pulled)} at module level"


def test_tests_mirror_the_package_without_path_edits_or_imports_of_other_test_modules():
    """Every test module sits in the folder of the package part it tests (no flat test_*.py beyond the
    package-wide ones), none edits sys.path, and none imports another test module (shared code lives in helper
    modules: tests/paths.py, tests/kernels/helpers.py, ...). The fault-injection script puts the checkout first
    when it runs as a script."""
    tests = ROOT.parent / "tests"
    flat = sorted(p.name for p in tests.glob("test_*.py"))
    assert set(flat) <= {"test_bad_input.py", "test_cli.py", "test_configfile.py", "test_doc_links.py",
                         "test_examples.py", "test_kernel_args.py", "test_package_layout.py", "test_packaging.py",
                         "test_readme.py",
                         "test_registry.py"}, flat
    problems = []
    for path in sorted(tests.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "sys.path.insert" \
                    and path.name != "fault_injection.py":
                problems.append(f"{path.relative_to(tests)}:{node.lineno}: edits sys.path")
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[-1].startswith("test_") \
                    and node.module.split(".")[-1] != path.stem:
                problems.append(f"{path.relative_to(tests)}:{node.lineno}: imports the test module {node.module}")
    assert not problems, "\n".join(problems)


MAX_MODULE_LINES = 400
MAX_PARAMETERS = 8


def test_no_module_is_over_400_lines():
    long = sorted(f"{m}: {n} lines" for m, path in MODULES.items()
                  if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES)
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by concern):\n" + "\n".join(long)


def test_no_function_takes_more_than_8_parameters():
    """Counted as written (positional, keyword-only; not self/cls, *args or **kwargs): related arguments travel
    as one dataclass."""
    many = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs) if x.arg not in ("self", "cls")]
                if len(names) > MAX_PARAMETERS:
                    many.append(f"{module}:{node.lineno} {node.name}: {len(names)} parameters")
    assert not many, "\n".join(many)


def _kernel_private_names() -> set[str]:
    """Underscored (not dunder) functions, methods and module attributes defined anywhere under kernels/."""
    names = set()
    for module, path in MODULES.items():
        if not module.startswith("hf_kernel_attn.kernels"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = node.name
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                name = node.targets[0].id
            else:
                continue
            if name.startswith("_") and not name.startswith("__"):
                names.add(name)
    return names


def test_nothing_outside_kernels_calls_a_private_kernel_name():
    """Outside kernels/, no call of an underscored method a kernel defines (``kernel._block_length(...)``) and
    no import of an underscored name from a kernels module: the rest of the package uses the public contract."""
    private = _kernel_private_names()
    assert len(private) > 20, "the reader found (almost) no private kernel names"
    found = []
    for module, path in MODULES.items():
        if module.startswith("hf_kernel_attn.kernels"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in private:
                found.append(f"{module}:{node.lineno}: {ast.unparse(node.func)}(...)")
            if isinstance(node, ast.ImportFrom) and node.module and "kernels" in node.module.split("."):
                found += [f"{module}:{node.lineno}: imports {a.name} from {node.module}"
                          for a in node.names if a.name.startswith("_")]
    assert not found, "private kernel names used outside kernels/:\n" + "\n".join(found)


DESIGN = ROOT.parent / "docs" / "design.md"
MAP_START, MAP_END = "<!-- package-map:start -->", "<!-- package-map:end -->"


def _part(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "<root>"
    return parts[1] + ("/" if MODULES[module].name == "__init__.py" or len(parts) > 2 else ".py")


def package_map() -> str:
    """The package drawn from its imports: per layer, each folder or module, how many modules it has, and the
    parts below it that it imports (the arrows; none may point up)."""
    parts: dict[str, set[str]] = defaultdict(set)
    arrows: dict[str, set[str]] = defaultdict(set)
    for module in MODULES:
        parts[_part(module)].add(module)
        for target in GRAPH[module]:
            if _part(target) != _part(module):
                arrows[_part(module)].add(_part(target))
    lines = ["```", "layer  part                 modules  imports (every arrow points down)"]
    for level in sorted(LAYERS, reverse=True):
        for part in sorted(p for p in parts if _layer(next(iter(parts[p]))) == level):
            below = sorted(arrows[part], key=lambda p: (-_layer(next(iter(parts[p]))), p))
            shown = [("(package root)" if p == "<root>" else p) for p in (part, *below)]
            lines.append(f"{level:>5}  {shown[0]:<22}{len(parts[part]):>5}    " + (", ".join(shown[1:]) or "-"))
    lines.append("```")
    return "\n".join(lines)


def test_the_package_map_in_design_md_is_drawn_from_the_code():
    text = DESIGN.read_text(encoding="utf-8")
    start, end = text.index(MAP_START) + len(MAP_START), text.index(MAP_END)
    drawn = "\n" + package_map() + "\n"
    if os.environ.get("HF_KERNEL_ATTN_WRITE_DOCS") == "1":
        DESIGN.write_text(text[:start] + drawn + text[end:], encoding="utf-8")
        text = DESIGN.read_text(encoding="utf-8")
        start, end = text.index(MAP_START) + len(MAP_START), text.index(MAP_END)
    assert text[start:end] == drawn, ("docs/design.md's package map is stale: rewrite it with "
                                      "HF_KERNEL_ATTN_WRITE_DOCS=1 pytest tests/test_package_layout.py")
