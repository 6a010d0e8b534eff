"""A non-editable install (pip install .) ships every package of the source tree."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup_packages():
    tree = ast.parse(open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "packages":
            return set(ast.literal_eval(node.value))
    raise AssertionError("setup.py has no packages= list")


def test_setup_lists_every_package():
    found = {"bertfast.kernels"}  # kernels/ installs as bertfast.kernels (package_dir)
    for root, dirs, files in os.walk(os.path.join(ROOT, "bertfast")):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
        if "__init__.py" in files:
            found.add(os.path.relpath(root, ROOT).replace(os.sep, "."))
    assert _setup_packages() == found
