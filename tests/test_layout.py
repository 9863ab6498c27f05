"""The package's large-scale shape, measured from its source (docs/architecture.md draws it):

- no import circle between its modules (every import counts: function-local and TYPE_CHECKING
  ones too, which hide a circle from Python but not from a reader);
- `core/` at the bottom: the vocabulary a handler speaks imports nothing that uses it;
- handlers import the vocabulary from `onnxshrink.core` and nothing above it; the analysis
  reaches no op module (it asks the registry);
- no function over 60 lines;
- no comparison of an op type with a string outside `ops/` (what an op means lives in its
  handler: ask it, through its static facts);
- the handler contract and the lookup name no `Any`, and mypy checks every generic's type
  arguments (`disallow_any_generics`);
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "onnxshrink"
MAX_LINES = 60


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module of ours `name` is, or is inside (a name imported from a module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> set[str]:
    """Every module of ours that `module` imports, wherever the import statement stands."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for name in names:
            found = _resolve(name) if name.startswith("onnxshrink") else None
            if found is not None and found != module:
                out.add(found)
    return out


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
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
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    edges = {m: imports(m) for m in MODULES}
    assert _circles(edges) == []


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# What each layer may import of ours, besides itself. core is the bottom of the pipeline's own
# code: below it only the plumbing every stage shares.
PLUMBING = {"onnxshrink.ir", "onnxshrink.errors", "onnxshrink.logs", "onnxshrink.progress", "onnxshrink.options"}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_core_is_at_the_bottom():
    for module in MODULES:
        if not _within(module, "onnxshrink.core"):
            continue
        above = {
            m
            for m in imports(module)
            if not _within(m, "onnxshrink.core") and not _within(m, "onnxshrink.io") and m not in PLUMBING
        }
        assert not above, f"{module} imports {sorted(above)}: core imports nothing that uses it"


def test_handlers_speak_core_and_the_analysis_knows_no_op():
    for module in MODULES:
        if _within(module, "onnxshrink.ops") and module != "onnxshrink.ops":
            above = {
                m
                for m in imports(module)
                if not _within(m, "onnxshrink.ops") and m not in ("onnxshrink.core", "onnxshrink.ir")
            }
            assert not above, f"{module} imports {sorted(above)}: a handler imports from onnxshrink.core"
        if _within(module, "onnxshrink.analyze") and module != "onnxshrink.analyze":
            ops = {m for m in imports(module) if _within(m, "onnxshrink.ops")}
            assert not ops, f"{module} imports {sorted(ops)}: the analysis asks the registry"


def _functions() -> Iterator[tuple[str, int]]:
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                yield f"{module}.{node.name}:{node.lineno}", node.end_lineno - node.lineno + 1


def test_no_function_over_60_lines():
    long = {name: n for name, n in _functions() if n > MAX_LINES}
    assert not long, f"functions over {MAX_LINES} lines: {long}"


def _op_expression(e: ast.expr) -> bool:
    """`node.op`, `n.op_type`, `op`, `op_type`: an op's type."""
    if isinstance(e, ast.Attribute):
        return e.attr in ("op", "op_type")
    return isinstance(e, ast.Name) and e.id in ("op", "op_type", "op_types")


def _strings(e: ast.expr, constants: dict[str, ast.expr]) -> bool:
    """A string, a collection of strings, or a module-level name bound to one."""
    if isinstance(e, ast.Name) and e.id in constants:
        e = constants[e.id]
    if isinstance(e, ast.Constant):
        return isinstance(e.value, str)
    if isinstance(e, ast.Tuple | ast.List | ast.Set):
        return bool(e.elts) and all(isinstance(x, ast.Constant) and isinstance(x.value, str) for x in e.elts)
    if isinstance(e, ast.Dict):
        return bool(e.keys) and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in e.keys)
    return False


def op_type_comparisons(path: Path) -> list[str]:
    """Where `path` compares an op type with a string (==, !=, in, a string method, a lookup
    keyed by op type)."""
    tree = ast.parse(path.read_text())
    constants = {
        t.id: node.value for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            if any(_op_expression(p) for p in parts) and any(_strings(p, constants) for p in parts):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if f.attr in ("startswith", "endswith") and _op_expression(f.value) or f.attr == "get" and node.args and _op_expression(node.args[0]) and _strings(f.value, constants):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Subscript) and _op_expression(node.slice) and _strings(node.value, constants):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_op_type_comparison_outside_ops():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel.startswith("onnxshrink/ops/"):
            continue
        found += op_type_comparisons(path)
    assert found == []


def test_the_op_type_finder_finds_each_form(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "KINDS = ('Conv', 'Gemm')\n"
        "def f(node, n, op):\n"
        "    a = node.op == 'Conv'\n"
        "    b = n.op_type in KINDS\n"
        "    c = op.startswith('QLinear')\n"
        "    d = {'Conv': 1}.get(node.op)\n"
        "    e = node.op == other\n"  # not a string: no finding
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert len(op_type_comparisons(src)) == 4
    finally:
        ROOT = saved


# The handler contract and the lookup, typed without Any: mypy checks every handler call.
CONTRACT = ("onnxshrink.core.handler", "onnxshrink.core.views", "onnxshrink.core.registry")


def test_the_handler_contract_and_the_lookup_name_no_any():
    for module in CONTRACT:
        tree = ast.parse(MODULES[module].read_text())
        found = [
            node.lineno
            for node in ast.walk(tree)
            if isinstance(node, ast.Name) and node.id == "Any"
            or isinstance(node, ast.Attribute) and node.attr == "Any"
            or isinstance(node, ast.alias) and node.name == "Any"
        ]
        assert not found, f"{module} names Any at lines {found}"


def test_mypy_checks_every_generic_with_its_type_arguments():
    text = (ROOT / "pyproject.toml").read_text()
    section = text[text.index("[tool.mypy]") :].split("\n[", 1)[0]
    assert "disallow_any_generics = true" in section
    assert "check_untyped_defs = true" in section
