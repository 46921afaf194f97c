"""The package's structure, held to what its docstring says.

`slackswap_ds/__init__.py` lists the layers bottom up. Read with `ast` (no extra dependency):

* no import cycle among the package's modules (lazy imports inside functions count: they are
  dependencies all the same);
* no import that points to a higher layer than the importing module's own;
* no import of another module's underscore names;
* the core and planning layers import no torch; the runtime package imports no planner and no
  hardware preset (re-planning policy belongs above it);
* no module over 500 lines (data tables excepted: `# size: data table` in its first lines), no class
  over 300 lines, no function over 60 lines unless `# long: <why>` is on its `def` line or the
  line above it; no class field typed `Any`.

`test_the_checks_fail_on_a_package_that_breaks_them` shows, on a small package written here,
that each check fails when its rule is broken.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "slackswap_ds"
TORCH_FREE_LAYERS = ("core", "planning")
MAX_MODULE_LINES, MAX_CLASS_LINES, MAX_FUNCTION_LINES = 500, 300, 60


# ---- reading a package ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Import:
    source: str  # importing module, dotted (package.sub.module)
    target: str  # imported module, dotted; for a third-party import, its top-level name
    names: tuple[str, ...]  # names taken from it (empty for `import x`)
    line: int


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_of(root: Path) -> dict[str, Path]:
    return {module_name(root, p): p for p in sorted(root.rglob("*.py"))}


def imports_of(root: Path, path: Path, modules: dict[str, Path]) -> list[Import]:
    """Every import in the file (at any depth), resolved to module names of the package."""
    source = module_name(root, path)
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [Import(source, a.name, (), node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = tuple(a.name for a in node.names)
            submodules = [n for n in names if f"{target}.{n}" in modules]
            for n in submodules:  # `from . import routing`: the module itself
                out.append(Import(source, f"{target}.{n}", (), node.lineno))
            rest = tuple(n for n in names if n not in submodules)
            if rest or not submodules:
                out.append(Import(source, target, rest, node.lineno))
    return out


def layer_rows(root: Path) -> list[list[str]]:
    """The rows of the block that follows the line starting with "Layers" in the package
    docstring: indented lines up to the first blank line after them; each `name member ...`."""
    doc = ast.get_docstring(ast.parse((root / "__init__.py").read_text())) or ""
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Layers")), None)
    assert start is not None, f"{root / '__init__.py'}: its docstring has no 'Layers' block"
    rows: list[list[str]] = []
    for line in lines[start + 1:]:
        if line.startswith("    ") and line.strip():
            rows.append(line.split())
        elif rows and not line.strip():
            break
    return rows


def read_layers(root: Path) -> dict[str, int]:
    """{top-level module or subpackage: layer index}; `__init__` is the package facade (top)."""
    rows = layer_rows(root)
    layers = {member: index for index, (_name, *members) in enumerate(rows) for member in members}
    layers["__init__"] = len(rows)
    return layers


def layer_names(root: Path) -> list[str]:
    return [row[0] for row in layer_rows(root)]


def top_of(root: Path, module: str) -> str:
    """The layer entry a module belongs to: its top-level module or subpackage under the root."""
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


# ---- the checks ------------------------------------------------------------------------------------
def check_imports(root: Path) -> list[str]:
    modules = modules_of(root)
    layers, names = read_layers(root), layer_names(root) + ["facade (__init__)"]
    pkg = root.name
    problems, graph = [], {m: set() for m in modules}
    for module, path in modules.items():
        top = top_of(root, module)
        if top not in layers:
            problems.append(f"{module}: not in any layer of {pkg}/__init__.py's docstring")
            continue
        for imp in imports_of(root, path, modules):
            if imp.target == pkg or imp.target.startswith(pkg + "."):
                target = imp.target if imp.target in modules else imp.target.rpartition(".")[0]
                if target not in modules:
                    continue
                if target != module:
                    graph[module].add(target)
                there = top_of(root, target)
                if there in layers and layers[there] > layers[top]:
                    problems.append(f"{module}:{imp.line}: imports {target} ({names[layers[there]]} layer) from the "
                                    f"{names[layers[top]]} layer below it")
                private = [n for n in imp.names if n.startswith("_") and not n.startswith("__")]
                if private and target != module:
                    problems.append(f"{module}:{imp.line}: imports {', '.join(private)} (underscore names) of {target}")
            elif imp.target.split(".")[0] == "torch" and names[layers[top]] in TORCH_FREE_LAYERS:
                problems.append(f"{module}:{imp.line}: imports torch in the torch-free {names[layers[top]]} layer")
    problems += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                found.append(sorted(component) + [sorted(component)[0]])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def check_sizes(root: Path) -> list[str]:
    problems = []
    for module, path in modules_of(root).items():
        text = path.read_text()
        lines = text.splitlines()
        if len(lines) > MAX_MODULE_LINES and not any("# size: data table" in line for line in lines[:40]):
            problems.append(f"{module}: {len(lines)} lines (at most {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_CLASS_LINES:
                    problems.append(f"{module}:{node.lineno}: class {node.name} has {length} lines "
                                    f"(at most {MAX_CLASS_LINES})")
                for item in ast.walk(node):  # class-level fields and `self.x: ...` in its methods
                    if isinstance(item, ast.AnnAssign) and re.search(r"\bAny\b", ast.unparse(item.annotation)):
                        target = ast.unparse(item.target).removeprefix("self.")
                        problems.append(f"{module}:{item.lineno}: field {node.name}.{target} is typed Any")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                said = "# long:" in lines[node.lineno - 1] or (first >= 2 and "# long:" in lines[first - 2])
                if length > MAX_FUNCTION_LINES and not said:
                    problems.append(f"{module}:{node.lineno}: function {node.name} has {length} lines "
                                    f"(at most {MAX_FUNCTION_LINES}, or a '# long: why' comment)")
    return problems


def check_runtime_imports(root: Path) -> list[str]:
    """The runtime package runs plans; what to plan again after a failure is decided above it."""
    modules = modules_of(root)
    problems = []
    for module, path in modules.items():
        if not module.startswith(f"{root.name}.runtime"):
            continue
        for imp in imports_of(root, path, modules):
            for banned in ("planners", "hardware"):
                if imp.target == f"{root.name}.{banned}" or imp.target.startswith(f"{root.name}.{banned}."):
                    problems.append(f"{module}:{imp.line}: the runtime imports {imp.target}")
    return problems


# ---- the package ---------------------------------------------------------------------------------
def test_imports_follow_the_layers_without_cycles_or_private_names():
    assert check_imports(PACKAGE) == []


def test_the_runtime_imports_no_planner_and_no_hardware_preset():
    assert check_runtime_imports(PACKAGE) == []


def test_modules_classes_and_functions_stay_small():
    assert check_sizes(PACKAGE) == []


def test_every_module_is_in_a_layer():
    layers = read_layers(PACKAGE)
    assert {top_of(PACKAGE, m) for m in modules_of(PACKAGE)} <= set(layers)


# ---- the checks can fail -------------------------------------------------------------------------
def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


_LAYERS = '"""A package.\n\nLayers, bottom up:\n\n    core  base other\n    upper top\n\nThe map:\n\n    base  not a layer\n"""\n'


def test_the_checks_fail_on_a_package_that_breaks_them(tmp_path):
    clean = _write(tmp_path / "clean" / "pkg", {
        "__init__.py": _LAYERS,
        "base.py": "X = 1\n",
        "other.py": "from .base import X\n",
        "top.py": "from .other import X\nfrom . import base\n",
    })
    assert check_imports(clean) == [] and check_sizes(clean) == []

    broken = _write(tmp_path / "broken" / "pkg", {
        "__init__.py": _LAYERS,
        "base.py": "def f():\n    from .other import Y  # lazy, still a dependency\n    return Y\n",
        "other.py": "import torch\nfrom .base import f, _hidden\nfrom .top import Z\nY = 1\n",
        "top.py": "Z = 1\n",
        "runtime/__init__.py": "",
    })
    problems = "\n".join(check_imports(broken))
    assert "import cycle: pkg.base -> pkg.other -> pkg.base" in problems
    assert "pkg.other:3: imports pkg.top (upper layer) from the core layer below it" in problems
    assert "pkg.other:2: imports _hidden (underscore names) of pkg.base" in problems
    assert "pkg.other:1: imports torch in the torch-free core layer" in problems
    assert "pkg.runtime: not in any layer" in problems

    big = _write(tmp_path / "big" / "pkg", {
        "__init__.py": _LAYERS,
        "base.py": "from typing import Any\n\n\nclass C:\n    x: Any\n\n    def __init__(self):\n        self.y: Any = 1\n"
                   "\n\ndef long():\n" + "    pass\n" * 61
                   + "\n\n# long: a state machine read top to bottom\ndef said():\n" + "    pass\n" * 61,
        "other.py": "X = 1\n" * 501,
        "top.py": "# size: data table\n" + "X = 1\n" * 501,
    })
    sizes = "\n".join(check_sizes(big))
    assert "pkg.base:11: function long has 62 lines" in sizes and "said" not in sizes
    assert "pkg.base:5: field C.x is typed Any" in sizes and "pkg.base:8: field C.y is typed Any" in sizes
    assert "pkg.other: 501 lines" in sizes and "pkg.top" not in sizes

    runtime = _write(tmp_path / "rt" / "pkg", {
        "__init__.py": _LAYERS,
        "base.py": "", "other.py": "", "top.py": "",
        "runtime/__init__.py": "", "runtime/executor.py": "from ..planners import PLANNERS\n",
        "planners/__init__.py": "PLANNERS = {}\n",
    })
    assert check_runtime_imports(runtime) == ["pkg.runtime.executor:1: the runtime imports pkg.planners"]


def test_the_package_docstring_maps_every_module():
    """The package docstring is the one module map (README.md and docs/ link to it): every module
    and subpackage has its line there."""
    doc = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text()))
    the_map = doc[doc.index("The map"):]
    files = [p for p in PACKAGE.rglob("*.py") if not p.name.startswith("__")]
    assert sorted(str(p.relative_to(PACKAGE)) for p in files if not re.search(rf"\b{p.stem}\b", the_map)) == []
