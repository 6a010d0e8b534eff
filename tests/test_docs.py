"""docs/architecture.md names every module of the package, so a newcomer finds each in one place."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_architecture_names_every_module():
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = []
    for path in sorted((ROOT / "bertfast").rglob("*.py")):
        rel = path.relative_to(ROOT / "bertfast")
        if rel.name in ("__init__.py", "__main__.py"):
            continue
        name = f"bertfast/{rel}" if len(rel.parts) == 1 else str(rel)
        if name not in text:
            missing.append(name)
    assert not missing, f"docs/architecture.md does not name: {missing}"
