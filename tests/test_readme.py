"""The README's snippet for other trainers runs as written."""

import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _run_snippet(index, tmp_path):
    snippet = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[index]
    script = tmp_path / "snippet.py"
    script.write_text(snippet)
    out = subprocess.run([sys.executable, "-W", "error::UserWarning", str(script)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_readme_ops_snippet_runs(tmp_path):
    assert "pg_clipfrac" in _run_snippet(0, tmp_path)


def test_readme_protocol_snippet_runs(tmp_path):
    out = _run_snippet(1, tmp_path)
    assert "[0, 3, 4, 8] torch.Size([3, 4])" in out


def test_readme_names_the_ci_commands():
    text = README.read_text()
    assert "<!-- ci:install -->" in text and "<!-- ci:test -->" in text
