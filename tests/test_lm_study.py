"""Chapter 05's study: the split by file, fair variants, the verdict arithmetic and a real (tiny) run."""
import dataclasses
import math

import pytest
import torch

from labutils import lm_study
from labutils.data import VOCAB, is_validation_file, stdlib_file_corpus, stdlib_sources

TINY = dataclasses.replace(lm_study.PRESETS["tiny"], steps=6, eval_every=3, val_tokens=2048, ablations=("top-1",))


def test_split_is_by_whole_file_and_stable(tmp_path):
    for name, text in {"a.py": "x = 1\n", "b.py": "y = 2\n", "pkg/c.py": "z = 3\n", "test/t.py": "skip\n",
                       "encodings/e.py": "skip\n"}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    files = stdlib_sources(str(tmp_path))
    assert files == ["a.py", "b.py", "pkg/c.py"]            # tests and codec tables are not ordinary source
    one_in = next(n for n in range(2, 50) if 0 < sum(is_validation_file(f, n) for f in files) < len(files))
    corpus = stdlib_file_corpus(one_in, root=str(tmp_path))
    table = torch.tensor([ord(c) for c in VOCAB], dtype=torch.uint8)
    val = bytes(table[corpus.val].tolist()).decode()
    train = bytes(table[corpus.train].tolist()).decode()
    for f in files:                                          # each file lies whole on exactly one side
        header = f"# ---- {f} ----"
        assert (header in val) == is_validation_file(f, one_in) and (header in train) != (header in val)
    assert corpus.vocab_size == 96 and corpus.sha256 == stdlib_file_corpus(one_in, root=str(tmp_path)).sha256


def test_a_split_with_an_empty_side_is_refused(tmp_path):
    (tmp_path / "only.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="empty split"):
        stdlib_file_corpus(2, root=str(tmp_path))


def test_moe_and_dense_have_equal_active_width_and_flops():
    cfg = lm_study.PRESETS["full"]
    v = lm_study.variants(cfg)
    assert v["MoE"].hidden * v["MoE"].top_k == v["dense"].hidden == v["top-1"].hidden
    assert v["dense-wide"].hidden == v["MoE"].hidden * v["MoE"].experts
    dense, moe = (lm_study.train_flops_per_token(cfg, v[n], 96) for n in ("dense", "MoE"))
    assert 1 < moe / dense < 1.03                           # the router only
    with pytest.raises(ValueError, match="unknown ablation"):
        lm_study.variants(dataclasses.replace(cfg, ablations=("top-3",)))


def test_steps_to_reach_interpolates_and_says_never():
    assert lm_study.steps_to_reach([100, 200, 300], [3.0, 2.0, 1.0], 1.5) == 250
    assert lm_study.steps_to_reach([100, 200], [1.0, 0.5], 2.0) == 100
    assert lm_study.steps_to_reach([100, 200], [3.0, 2.0], 1.0) is None
    assert lm_study.steps_to_reach([1, 2, 3], [3.0, 1.0, 2.0], 1.5) == pytest.approx(1.75)


def fake_record(finals: dict, steps=(100, 200)) -> dict:
    runs = [{"name": n, "seed": s, "val_steps": list(steps), "val": [v + 1.0, v], "flops_per_step": 1,
             "train_seconds": [1.0, 2.0]} for n, vals in finals.items() for s, v in enumerate(vals)]
    return {"runs": runs, "jobs": 1, "config": {"name": "test", "threads": 1}}


def test_summarize_writes_the_verdict_from_the_numbers():
    win = lm_study.summarize(fake_record({"dense": [2.0, 2.01, 1.99], "MoE": [1.8, 1.81, 1.79],
                                          "dense-wide": [1.7, 1.71, 1.69]}))
    assert win["gap"] == pytest.approx(0.2) and win["moe_wins"] and win["regime_ok"]
    assert win["speedups"] == pytest.approx([200 / 180] * 3, rel=0.02)  # MoE crosses 2.0 at 180 of 200 steps
    lines = "\n".join(lm_study.verdict_lines(win))
    assert "MoE is better, beyond the noise" in lines and "NOT met" in lines
    # negative control: a gap inside the seed spread is inconclusive, and the regime check says why
    noisy = lm_study.summarize(fake_record({"dense": [2.0, 2.2, 1.8], "MoE": [1.95, 2.15, 1.75],
                                            "dense-wide": [1.98, 2.18, 1.78]}))
    assert not noisy["moe_wins"] and not noisy["regime_ok"]
    assert "inconclusive" in "\n".join(lm_study.verdict_lines(noisy))


def test_a_tiny_study_runs_is_seeded_and_parallel_runs_match():
    one = lm_study.run_study(TINY, jobs=1, log=None)
    names = [(r["name"], r["seed"]) for r in one["runs"]]
    assert names == [(n, s) for s in TINY.seeds for n in lm_study.MAIN] + [("top-1", TINY.seeds[0])]
    assert all(math.isfinite(v) and v < math.log(96) + 0.5 for r in one["runs"] for v in r["val"])
    again = lm_study.run_one(TINY, "MoE", TINY.seeds[1])
    assert again["val"] == one["runs"][4]["val"]            # same seed, same curve, bit for bit
    assert one["runs"][1]["val"] != one["runs"][4]["val"]    # another seed, another curve
    two = lm_study.run_study(TINY, jobs=2, log=None)         # spawned workers: same numbers as in-process
    assert [r["val"] for r in two["runs"]] == [r["val"] for r in one["runs"]]
    assert len(one["runs"][1]["load"][0]) == TINY.num_expert and lm_study.load_shares(one).shape[1] == 8


def test_ablations_are_judged_against_the_same_seed_and_the_seed_spread():
    record = fake_record({"dense": [2.0, 2.0], "MoE": [1.80, 1.82], "dense-wide": [1.7, 1.7],
                          "top-1": [1.70], "E=4": [1.81]})
    lines = lm_study.ablation_lines(record)                   # MoE seed std 0.014: 2 x = 0.028
    assert lines[0].startswith("top-1") and "-0.1000" in lines[0] and "better than MoE" in lines[0]
    assert lines[1].startswith("E=4") and "+0.0100" in lines[1] and "within the noise" in lines[1]


def test_bad_input_is_refused_with_a_clear_message():
    with pytest.raises(ValueError, match="need at least block"):
        lm_study.heldout_loss(torch.nn.Identity(), torch.arange(10), block=64)
    with pytest.raises(ValueError, match="jobs >= 1"):
        lm_study.run_study(TINY, jobs=0)
    with pytest.raises(ValueError, match="at least one seed"):
        lm_study.run_study(dataclasses.replace(TINY, seeds=()))
    with pytest.raises(ValueError, match="unknown ablation"):
        lm_study.run_study(dataclasses.replace(TINY, ablations=("top-9",)))
    with pytest.raises(ValueError, match=r"no run of \['dense-wide'\]"):
        lm_study.summarize(fake_record({"dense": [2.0, 2.0], "MoE": [1.9, 1.9]}))
