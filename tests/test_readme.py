"""The Python examples of the README and of docs/API.md run as written (on a GPU)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "docs" / "API.md"]


def _runnable(path: Path) -> list:
    """The ```python blocks of a document that import cupaged (the others are fragments)."""
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), re.S)
    return [b for b in blocks if "import cupaged" in b]


EXAMPLES = [(path, code) for path in DOCS for code in _runnable(path)]


def test_readme_has_runnable_examples():
    assert len(_runnable(DOCS[0])) >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("path, code", EXAMPLES,
                         ids=[f"{p.name}-example{i}" for i, (p, _) in enumerate(EXAMPLES)])
def test_example_runs(path, code):
    exec(compile(code, str(path), "exec"), {})
