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


def test_readme_commands_parse_into_configs(monkeypatch):
    """Every ``rlcore train`` / ``export`` line of the README names options its recipe has, with
    values its Config accepts (nothing is run: the model paths are placeholders)."""
    import shlex

    from rlcore.loops.cli import _config, build_parser
    from rlcore.loops.recipes import RECIPES

    text = README.read_text().replace("\\\n", " ")
    commands = [shlex.split(line.split("#")[0])[1:] for line in text.splitlines()
                if re.match(r"\.venv/bin/rlcore (train|export) ", line) and "--help" not in line]
    monkeypatch.chdir(README.parent)  # the configs/ paths the README names
    assert any("--use_peft" in c for c in commands) and any(c[0] == "export" for c in commands)
    for argv in commands:
        args = build_parser(argv).parse_args(argv)
        if argv[0] == "train":
            _config(RECIPES[args.recipe], args)
