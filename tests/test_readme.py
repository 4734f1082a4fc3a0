"""The README's snippet for other trainers runs as written."""

import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_snippet_runs(tmp_path):
    snippet = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    script = tmp_path / "snippet.py"
    script.write_text(snippet)
    out = subprocess.run([sys.executable, "-W", "error::UserWarning", str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pg_clipfrac" in out.stdout


def test_readme_names_the_ci_commands():
    text = README.read_text()
    assert "<!-- ci:install -->" in text and "<!-- ci:test -->" in text
