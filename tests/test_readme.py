"""The README's Python example runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert blocks, "the README has no python example"
    exec(compile(blocks[0], str(README), "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert "loss_policy" in out and "loss_value" in out


def test_readme_gives_the_two_commands():
    text = README.read_text()
    assert "make demo" in text and "make test" in text
    ci = (README.parent / ".ci" / "run").read_text()
    assert "make test" in ci
