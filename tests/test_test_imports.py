"""The suite's own imports of bertfast resolve here, in every test, the GPU-only ones included.

A GPU test skips on this machine before its body runs, so a name it imports from bertfast that
moved or was renamed is found only on a lent GPU, where it costs a failing test and the loan's
time (the H200 run of 2026-11-27's third loan: `row_stride` imported from its old module).
"""
import ast
import importlib
import pathlib

TESTS = pathlib.Path(__file__).parent


def bertfast_imports(root: pathlib.Path):
    """(file:line, module, name) for every `from bertfast... import name` under root, at any depth."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "bertfast":
                where = f"{path.relative_to(root)}:{node.lineno}"
                found += [(where, node.module, alias.name) for alias in node.names]
    return found


def missing_imports(imports):
    """The imports that fail here, each with its file and line."""
    missing = []
    for where, module, name in imports:
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            if "bertfast._C" not in str(exc):  # the CUDA extension, absent without nvcc: its tests skip
                missing.append(f"{where}: module {module}: {exc}")
            continue
        if name == "*" or hasattr(mod, name):
            continue
        try:
            importlib.import_module(f"{module}.{name}")
        except ImportError:
            missing.append(f"{where}: {module} has no {name}")
    return missing


def test_every_bertfast_name_the_tests_import_exists():
    imports = bertfast_imports(TESTS)
    assert len(imports) > 100  # the walk reaches the imports inside test functions
    assert not missing_imports(imports), "\n".join(missing_imports(imports))


def test_a_moved_name_is_found(tmp_path):
    """The check finds the import the GPU run failed on, written as it was."""
    (tmp_path / "test_probe.py").write_text(
        "def test_gpu():\n    from bertfast.kernels._rows import n_bucket, row_stride\n")
    assert missing_imports(bertfast_imports(tmp_path)) == ["test_probe.py:2: bertfast.kernels._rows has no row_stride"]
