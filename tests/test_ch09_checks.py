"""Chapter 09's Holm correction (``labbook.train_modern.holm``) and its use in ``dense_verdicts`` (issue 38)."""
import math

from labbook import train_modern


def test_holm_matches_the_step_down_values_worked_by_hand():
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04 -> made non-decreasing: 0.06
    got = train_modern.holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005})
    assert {k: round(v, 12) for k, v in got.items()} == {"a": 0.03, "b": 0.06, "c": 0.06, "d": 0.02}


def test_holm_caps_at_one_and_leaves_untestable_arms_out_of_the_family():
    got = train_modern.holm({"a": 0.7, "b": 0.6, "c": 0.01, "n": float("nan")})   # m = 3: the NaN is not counted
    assert math.isclose(got["c"], 0.03) and got["b"] == 1.0 and got["a"] == 1.0 and math.isnan(got["n"])


def _record(gaps):
    base = [1.70, 1.72, 1.71]
    variants = [{"name": "dense", "final": base, "final_prefix": base}]
    for i, d in enumerate(gaps):
        vals = [v - d for v in base]
        variants.append({"name": f"v{i}", "final": vals, "final_prefix": vals})
    return {"variants": variants}


def test_dense_verdicts_are_holm_corrected():
    record = _record([0.03] * 9)          # nine equal gaps: each Welch p ~ 0.02 (ahead), Holm 9 p (inconclusive)
    raw = dict(train_modern.versus({v["name"]: v["final"] for v in record["variants"][1:]},
                                                 "dense", record["variants"][0]["final"]))
    out = train_modern.dense_verdicts(record)
    for n, (c, basis, causal) in out.items():
        assert causal and basis == "final" and "Holm-adjusted over 9" in c.test
        assert raw[n].verdict == "ahead" and raw[n].p < 0.05
        assert math.isclose(c.p, min(1.0, 9 * raw[n].p)) and c.verdict == "inconclusive"


def test_chapter_09_reads_its_record_from_the_repository_not_the_working_directory():
    import json
    import pathlib

    nb = json.loads((pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "09_modern_moe.ipynb").read_text())
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert "../benchmarks" not in code and 'records.load(RECORD)' in code
    assert "reference_modern_moe" not in code          # the parity reference is written in the chapter


def test_chapter_09_teaches_each_idea_before_checking_them_all_against_the_reference():
    """Issue 39: sections 2-7 show one switch each; the parity cell (every switch against the token-by-token
    reference) follows them, in its own section, before the training."""
    import json
    import pathlib

    nb = json.loads((pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "09_modern_moe.ipynb").read_text())
    ids = [c.get("id") for c in nb["cells"]]
    heads = {"".join(c["source"]).split("\n")[0]: i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "markdown"
             and "".join(c["source"]).startswith("## ")}
    at = {h.split(".")[0][3:]: i for h, i in heads.items() if h[3:4].isdigit()}
    assert list(at) == [str(n) for n in range(1, 11)], list(heads)
    parity, reference = ids.index("e6eb5964"), ids.index("a1c09e7f")
    assert at["7"] < at["8"] < reference < parity < at["9"]
    assert "reference" in next(h for h, i in heads.items() if i == at["8"])
