"""README's promises that code can check: CI runs README's test command verbatim."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", readme, re.DOTALL).group(1)
    commands = [line for line in first_block.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2, "the first screen has exactly two commands: set up + run, set up + test"
    assert commands[1] in (ROOT / ".ci" / "run").read_text()
