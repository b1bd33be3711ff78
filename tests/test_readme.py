"""The README's Python examples run as written (on a GPU)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
RUNNABLE = [b for b in BLOCKS if "import cupaged" in b]


def test_readme_has_runnable_examples():
    assert len(RUNNABLE) >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("code", RUNNABLE, ids=[f"example{i}" for i in range(len(RUNNABLE))])
def test_readme_example_runs(code):
    exec(compile(code, str(README), "exec"), {})
