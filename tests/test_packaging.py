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


def test_the_checkouts_kernels_directory_does_not_shadow_a_kernels_package(tmp_path):
    """Run from the checkout's root, Python finds kernels/ first for `import kernels`; transformers 5.25
    imports the Hugging Face package of that name, so the directory hands the import to the next
    `kernels` on sys.path (kernels/__init__.py), or says what it is when there is none."""
    import subprocess
    import sys

    other = tmp_path / "kernels"
    other.mkdir()
    (other / "__init__.py").write_text("MARK = 'the other kernels'\n")
    (other / "part.py").write_text("from . import MARK as SEEN\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    code = "import kernels, kernels.part; print(kernels.MARK, kernels.part.SEEN, sep=';')"
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "the other kernels;the other kernels", res.stderr
    # -S: no site-packages (where the Hugging Face package may be): only the checkout's directory
    res = subprocess.run([sys.executable, "-S", "-c", "import kernels"], cwd=ROOT, capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert res.returncode == 1 and "which is bertfast's Triton kernels: import bertfast.kernels" in res.stderr
    res = subprocess.run([sys.executable, "-c", "import bertfast.kernels.attention as a; print(a.DQ_ENV)"],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "BERTFAST_ATTENTION_DQ", res.stderr
