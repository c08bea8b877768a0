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


def _layout_paths():
    """The paths the README's layout tree names (directories end in '/')."""
    text = README.read_text()
    section = text[text.index("## Layout"):]
    block = re.search(r"```\n(.*?)```", section, flags=re.S).group(1)
    paths, parents = [], []
    for line in block.splitlines():
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0]
        parents = parents[:depth]
        path = "".join(parents) + name
        paths.append(path)
        if name.endswith("/"):
            parents.append(name)
    return paths


def test_readme_layout_matches_the_tree():
    root = README.parent
    listed = _layout_paths()
    missing = [p for p in listed if not (root / p).exists()]
    assert not missing, f"the README's layout names paths that do not exist: {missing}"
    package = sorted(str(p.relative_to(root)) for p in (root / "numba_cp").rglob("*.py"))
    unlisted = [p for p in package if p not in listed]
    assert not unlisted, f"modules missing from the README's layout: {unlisted}"
    tops = {p.split("/")[0] + "/" for p in listed}
    for folder in ("numba_cp", "docs", "launch", "benchmarks", "tests", "tools", "results"):
        assert folder + "/" in tops, folder
