"""Every result sentence in README.md is generated from the records (tools/readme_results.py): the README must say
exactly what the generator says today, so a re-recorded benchmark or a changed verdict cannot leave stale prose."""
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import readme_results  # noqa: E402


def test_readme_result_spans_match_the_records():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "readme_results.py"), "--check"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_check_fails_on_a_stale_span_and_on_an_unknown_one():
    text = (ROOT / "README.md").read_text()
    assert "<!-- gen:bench-launch -->" in text
    stale = text.replace("<!-- gen:bench-launch -->", "<!-- gen:bench-launch -->0.01 s faster than light; ", 1)
    _, changed = readme_results.render(stale)
    assert changed == ["bench-launch"]
    with pytest.raises(KeyError, match="gen:no-such-record"):
        readme_results.render("<!-- gen:no-such-record -->x<!-- /gen -->")
