"""The README's API example runs as written (against the simulator or a GPU)."""

import re
from pathlib import Path

import pytest

from numba_cp import backend

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_api_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    example = blocks[0]
    assert "numba_cp.local_topk_keys" in example and "merge_topk_keys" in example
    if not backend.is_simulator:
        pytest.skip("the example is written on NumPy arrays, for the simulator")
    exec(compile(example, str(README), "exec"), {})


def test_readme_starts_with_the_two_commands():
    lines = README.read_text().splitlines()
    fence = lines.index("```bash")
    assert lines[fence + 1].startswith("bash launch/run_exchange.sh")
    assert lines[fence + 2].startswith("bash tests/run.sh")
    assert "bash tests/run.sh" in (README.parent / ".ci" / "run").read_text()
