"""tools/mutate.py's --rescore: a recorded run re-counted after a review, without running mutmut (issue 38)."""
from __future__ import annotations

import hashlib
import json
import pathlib

import pytest
from script_loader import load_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULE = "labutils/moe/tree.py"                                            # any real module: its sha is read


@pytest.fixture
def mutate(tmp_path, monkeypatch):
    tool = load_script(ROOT / "tools" / "mutate.py", "mutate_tool_under_test")
    monkeypatch.setattr(tool, "EQUIVALENT", tmp_path / "equivalent.json")
    return tool


def _record(sha: str) -> dict:
    # 20 mutants: 16 killed, 1 equivalent, 3 survivors -> 16/19
    return {"modules": {MODULE: {"mutants": 20, "killed": 16, "equivalent": 1, "gpu_only": 0, "score": 0.8421,
                                 "survivors": ["m.a", "m.b", "m.c"], "commit": "abc1234", "source_sha": sha}}}


def test_rescore_moves_reviewed_survivors_out_of_the_denominator(mutate):
    sha = hashlib.sha256((ROOT / MODULE).read_bytes()).hexdigest()[:16]
    mutate.EQUIVALENT.write_text(json.dumps({"m.a": {"reason": "same value"},
                                             "m.c": {"reason": "a device only", "kind": "gpu-only"}}))
    r = mutate.rescore(MODULE, _record(sha))
    assert r["survivors"] == ["m.b"] and (r["equivalent"], r["gpu_only"], r["killed"]) == (2, 1, 16)
    assert r["score"] == round(16 / 17, 4) and r["rescored"] == 2
    assert r["commit"] == "abc1234"                                        # still the run's commit: nothing re-ran


def test_rescore_refuses_a_record_of_other_source(mutate):
    mutate.EQUIVALENT.write_text("{}")
    with pytest.raises(SystemExit, match="source changed since the recorded run \\(commit abc1234\\)"):
        mutate.rescore(MODULE, _record("0" * 16))
