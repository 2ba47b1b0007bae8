"""The README opens with the two commands, and CI runs the second one verbatim."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands():
    return re.findall(r"```\n(.+?)\n```", (ROOT / "README.md").read_text())[:2]


def test_readme_starts_with_two_commands_and_ci_runs_the_second():
    demo, tests = readme_commands()
    assert demo.endswith("jobs demo") and "pip install" in demo
    assert "pytest" in tests
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci
