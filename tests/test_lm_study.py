"""Chapter 05's study: the split by file, fair variants, the verdict arithmetic and a real (tiny) run."""
import dataclasses
import hashlib
import time

import pytest
import torch

from labbook.lm_study import config, data_checks, runner, summary
from labutils.data import VOCAB, is_validation_file, stdlib_file_corpus, stdlib_sources
from labutils.moe.gates import collect_aux_loss

TINY = dataclasses.replace(config.PRESETS["tiny"], steps=6, eval_every=3, val_tokens=2048, ablations=("top-1",))


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
    cfg = config.PRESETS["full"]
    v = config.variants(cfg)
    assert v["MoE"].hidden * v["MoE"].top_k == v["dense"].hidden == v["top-1"].hidden
    assert v["dense-wide"].hidden == v["MoE"].hidden * v["MoE"].experts
    dense, moe = (config.train_flops_per_token(cfg, v[n], 96) for n in ("dense", "MoE"))
    assert 1 < moe / dense < 1.03                           # the router only
    with pytest.raises(ValueError, match="unknown ablation"):
        config.variants(dataclasses.replace(cfg, ablations=("top-3",)))


def test_steps_to_reach_interpolates_and_says_never():
    assert summary.steps_to_reach([100, 200, 300], [3.0, 2.0, 1.0], 1.5) == 250
    assert summary.steps_to_reach([100, 200], [1.0, 0.5], 2.0) == 100
    assert summary.steps_to_reach([100, 200], [3.0, 2.0], 1.0) is None
    assert summary.steps_to_reach([1, 2, 3], [3.0, 1.0, 2.0], 1.5) == pytest.approx(1.75)


def fake_record(finals: dict, steps=(100, 200), name="test") -> dict:
    runs = [{"name": n, "seed": s, "val_steps": list(steps), "val": [v + 1.0, v], "flops_per_step": 1,
             "train_seconds": [1.0, 2.0]} for n, vals in finals.items() for s, v in enumerate(vals)]
    return {"runs": runs, "jobs": 1, "config": {"name": name, "threads": 1}}


def test_summarize_tests_every_pair_and_the_speedup_interval():
    win = summary.summarize(fake_record({"dense": [2.0, 2.01, 1.99], "MoE": [1.8, 1.81, 1.79],
                                          "dense-wide": [1.7, 1.71, 1.69]}))
    assert win["moe_vs_dense"].verdict == "ahead" and win["moe_vs_dense"].diff == pytest.approx(-0.2)
    assert win["wide_vs_dense"].verdict == "ahead" and win["moe_vs_wide"].verdict == "behind"
    sp = win["speedup"]
    assert sp["pairs"] == sp["reached"] == 9 and sp["ci"][0] <= sp["mean"] <= sp["ci"][1]
    # each pair: dense seed i's final loss, reached by MoE seed j on its straight line from 2.8 to 1.8
    want = [200 / (100 + 100 * (2.8 + 0.01 * j - d) / 1.0) for d in (2.0, 2.01, 1.99) for j in (0, 1, -1)]
    assert sorted(sp["values"]) == pytest.approx(sorted(want))
    lines = "\n".join(summary.verdict_lines(win))
    assert "MoE is ahead of dense" in lines and "preset test" in lines and "NOT met" in lines  # 1.11 < 1.3
    assert "met (the interval's lower bound clears it)" in "\n".join(summary.verdict_lines(win, 1.05))


def test_two_seeds_are_inconclusive_whatever_the_means_and_never_meet_a_target():
    two = summary.summarize(fake_record({"dense": [2.0, 2.01], "MoE": [1.5, 1.51], "dense-wide": [1.4, 1.41]}))
    assert two["moe_vs_dense"].verdict == two["wide_vs_dense"].verdict == "inconclusive"
    assert not summary.target_met(two["speedup"], 1.0)     # 4 pairs: fewer than 3 seeds per arm
    lopsided = summary.summarize(fake_record({"dense": [2.0, 2.01, 1.99, 2.0, 2.01], "MoE": [1.5, 1.51],
                                               "dense-wide": [1.4, 1.41, 1.39]}))
    assert lopsided["speedup"]["pairs"] == 10 and not summary.target_met(lopsided["speedup"], 1.0)  # MoE: 2
    lines = "\n".join(summary.verdict_lines(two))
    assert "inconclusive (fewer than 3 seeds in an arm)" in lines and "NOT shown" in lines
    # negative control: the same gaps with 3 seeds per arm do clear
    three = summary.summarize(fake_record({"dense": [2.0, 2.01, 1.99], "MoE": [1.5, 1.51, 1.49],
                                            "dense-wide": [1.4, 1.41, 1.39]}))
    assert three["moe_vs_dense"].verdict == "ahead" and summary.target_met(three["speedup"], 1.0)


def test_equal_time_compares_every_run_at_the_shortest_training_time():
    record = fake_record({"dense": [2.0, 2.01, 1.99], "MoE": [1.9, 1.91, 1.89], "dense-wide": [1.8, 1.81, 1.79]},
                         steps=(100, 200, 300))   # a little spread per arm: zero spread is refused by stats.welch
    for r in record["runs"]:
        r["val"] = [r["val"][0], (r["val"][0] + r["val"][1]) / 2, r["val"][1]]
        r["train_seconds"] = [1.0, 2.0, 3.0] if r["name"] != "MoE" else [2.0, 4.0, 6.0]  # MoE twice as slow
    eq = summary.summarize(record)["equal_time"]
    assert eq["seconds"] == 3.0 and eq["unreached"] == 0
    # at 3 s dense is at its end (2.0); MoE is halfway between its first two evaluations: 2.9 - 0.25 = 2.65
    assert eq["comparison"].mean_a == pytest.approx(2.65) and eq["comparison"].mean_b == pytest.approx(2.0)
    assert eq["comparison"].verdict == "behind"


def test_ablations_are_tested_against_the_moe_mean():
    record = fake_record({"dense": [2.0, 2.0, 2.0], "MoE": [1.80, 1.82, 1.81], "dense-wide": [1.7, 1.7, 1.7],
                          "top-1": [1.90, 1.91, 1.92], "E=4": [1.81]})
    comp = summary.ablation_comparisons(record)
    assert comp["top-1"].verdict == "behind" and comp["top-1"].n_a == 3
    assert comp["E=4"].verdict == "inconclusive" and comp["E=4"].n_a == 1   # one seed cannot be tested
    lines = summary.ablation_lines(record)
    assert lines[0].startswith("top-1 is behind MoE") and "inconclusive" in lines[1]


def test_flops_counted_by_torch_equal_the_analytic_count_for_every_variant():
    cfg = dataclasses.replace(config.PRESETS["tiny"], batch=2, ablations=config.ABLATIONS)
    for name, v in config.variants(cfg).items():
        measured, analytic = config.measured_train_flops(cfg, v, 96), config.train_flops_per_token(cfg, v, 96) * 64
        if v.gate == "switch":   # tokens over capacity skip the experts: fewer FLOPs, never more
            assert 0.8 * analytic < measured <= analytic, name
        else:
            assert measured == analytic, name
    # negative control: the count of a variant with one router matmul fewer does not match the NoisyGate model
    moe = config.variants(cfg)["MoE"]
    wrong = dataclasses.replace(moe, gate="switch")
    assert config.measured_train_flops(cfg, moe, 96) != config.train_flops_per_token(cfg, wrong, 96) * 64


def test_shared_windows_finds_a_leaked_file_and_not_a_clean_split():
    g = torch.Generator().manual_seed(0)
    train, val = torch.randint(96, (20_000,), generator=g), torch.randint(96, (3_000,), generator=g)
    assert not data_checks.shared_windows(train, val, 32).any()                     # random text shares nothing
    leaked = torch.cat([train[:5000], val[1000:2000], train[5000:]])          # a piece of validation in training
    covered = data_checks.shared_windows(leaked, val, 32)
    assert covered[1000:2000].all() and not covered[:1000].any() and not covered[2000:].any()
    with pytest.raises(ValueError, match="width=64"):
        data_checks.shared_windows(train, val[:10], 64)


def test_file_coverage_names_the_validation_file_copied_from_training(tmp_path):
    body = "def f(x):\n    return sorted(set(x), key=len)  # long enough to share\n" * 3
    texts = {f"m{i}.py": hashlib.sha256(str(i).encode()).hexdigest() + "\n" for i in range(40)}  # unrelated
    texts["twin_a.py"] = texts["twin_b.py"] = body            # the same text under two names
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
    one_in = next(n for n in range(2, 200) if is_validation_file("twin_a.py", n) != is_validation_file("twin_b.py", n)
                  and any(is_validation_file(f, n) for f in texts if not f.startswith("twin")))
    corpus = stdlib_file_corpus(one_in, root=str(tmp_path))
    val_files = [f for f in sorted(texts) if is_validation_file(f, one_in)]
    cov = data_checks.file_coverage(corpus, data_checks.shared_windows(corpus.train, corpus.val, 16), val_files)
    twin = next(f for f in val_files if f.startswith("twin"))
    assert cov[twin][1] > 0.8 and all(v < 0.5 for f, (_, v) in cov.items() if f != twin)
    with pytest.raises(ValueError, match="not in the validation text"):
        data_checks.file_coverage(corpus, torch.zeros(len(corpus.val), dtype=torch.bool), ["nowhere.py"])


def test_window_coverage_replays_the_run_and_matches_the_poisson_share():
    cfg = dataclasses.replace(config.PRESETS["tiny"], steps=400, batch=16, block=32)
    cov = data_checks.window_coverage(cfg, 200_000, seed=0)                         # ~1.0 epoch
    assert cov["epochs"] == pytest.approx(400 * 16 * 32 / 200_000)
    assert cov["twice_share"] == pytest.approx(cov["poisson_twice_share"], abs=0.02)
    assert 0.3 < cov["twice_share"] < 0.5


def test_the_training_clock_leaves_evaluations_out():
    now = [0.0]
    clock = runner.TrainClock(lambda: now[0])
    now[0] = 5.0                       # 5 s of training
    clock.eval_start()
    now[0] = 105.0                     # a 100 s evaluation
    clock.eval_end()
    now[0] = 108.0                     # 3 s more training
    assert clock.eval_start() == 8.0 and clock.eval_seconds == 100.0
    with pytest.raises(RuntimeError, match="without eval_start"):
        runner.TrainClock().eval_end()


def test_a_run_leaves_its_evaluations_off_the_training_clock(monkeypatch):
    real = runner.heldout_loss

    def slow(*args, **kwargs):                 # every evaluation burns at least 1 s of CPU
        t = time.process_time()
        while time.process_time() - t < 1.0:
            pass
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "heldout_loss", slow)  # the runner's own name, which run_one calls
    run = runner.run_one(TINY, "dense", 0)   # 6 steps, evaluations after steps 3 and 6
    assert run["clock"] == "process_time" and run["eval_seconds"] >= 2.0
    assert run["train_seconds"][1] - run["train_seconds"][0] < 1.0   # 3 tiny steps; with the evaluation >= 1 s


def test_the_training_clock_charges_cpu_seconds_not_waiting():
    clock = runner.TrainClock()              # default: the process's CPU time
    time.sleep(0.5)                            # waiting for a core shared with another run
    assert clock.eval_start() < 0.2


def test_the_switch_gate_top1_router_gets_a_task_gradient():
    cfg = config.PRESETS["tiny"]
    grads = {}
    for name in ("top-1", "top-1 Switch"):
        layer = config.variants(dataclasses.replace(cfg, ablations=("top-1", "top-1 Switch")))[name].ffn(32)
        torch.manual_seed(0)
        layer(torch.randn(64, 32)).pow(2).sum().backward()
        grads[name] = max(p.grad.abs().max().item() for p in layer.gate.parameters())
    assert grads["top-1"] == 0.0 and grads["top-1 Switch"] > 1e-4


def test_data_limited_control_trains_on_a_slice():
    cfg = config.data_limited(config.PRESETS["full"])
    assert cfg.train_chars == 1_000_000 and cfg.ablations == () and 4 < config.epochs(cfg, cfg.train_chars) < 4.2
    with pytest.raises(ValueError, match="train_chars=10 must exceed block"):
        runner.run_study(dataclasses.replace(TINY, train_chars=10))


def test_bad_input_is_refused_with_a_clear_message():
    with pytest.raises(ValueError, match="need at least block"):
        runner.heldout_loss(torch.nn.Identity(), torch.arange(10), block=64)
    with pytest.raises(ValueError, match="jobs >= 1"):
        runner.run_study(TINY, jobs=0)
    with pytest.raises(ValueError, match="at least one seed"):
        runner.run_study(dataclasses.replace(TINY, seeds=()))
    with pytest.raises(ValueError, match="unknown ablation"):
        runner.run_study(dataclasses.replace(TINY, ablations=("top-9",)))
    with pytest.raises(ValueError, match=r"no run of \['dense-wide'\]"):
        summary.summarize(fake_record({"dense": [2.0, 2.0], "MoE": [1.9, 1.9]}))


def test_both_studies_share_one_preset_type_read_as_attributes_and_as_a_mapping(monkeypatch):
    from labbook import study, train_modern
    from labutils import select_preset

    monkeypatch.delenv("LAB_PRESET", raising=False)
    for presets in (config.PRESETS, train_modern.PRESETS):
        assert set(presets) == {"tiny", "full"}
        for name, cfg in presets.items():
            assert isinstance(cfg, study.StudyPreset) and cfg.name == name
            assert list(cfg) == [f.name for f in dataclasses.fields(cfg)][:-1] and "name" not in cfg
            assert cfg["lr"] == cfg.lr and dict(cfg)["seeds"] == cfg.seeds and cfg.record()["seeds"] == list(cfg.seeds)
        picked = select_preset(**presets, verbose=False)       # labutils' own mechanism takes them as it takes dicts
        assert picked.as_dict() == dict(presets["tiny"])
    with pytest.raises(KeyError, match="no knob 'name'"):
        train_modern.PRESETS["tiny"]["name"]
    assert dataclasses.asdict(config.PRESETS["tiny"])["name"] == "tiny"   # chapter 05's record keeps the whole config


def _cube(x):
    return x ** 3


def test_run_jobs_keeps_the_task_order_in_process_and_side_by_side():
    from labbook.study import run_jobs

    for jobs in (1, 2):
        seen = []
        assert run_jobs(_cube, [(3,), (1,), (2,)], jobs, seen.append) == [27, 1, 8]
        assert sorted(seen) == [1, 8, 27]                       # done() saw every result (in finishing order)


def test_versus_is_welch_against_the_reference_arm():
    from labbook.study import versus
    from labutils import stats

    arms = {"a": [1.0, 1.1, 0.9], "b": [2.0, 2.1, 1.9]}
    got = versus(arms, "ref", [1.5, 1.6, 1.4])
    assert list(got) == ["a", "b"] and [c.verdict for c in got.values()] == ["ahead", "behind"]
    assert repr(got["a"]) == repr(stats.welch(arms["a"], [1.5, 1.6, 1.4], names=("a", "ref")))


def test_the_study_optimizer_is_adam_fused_and_updates_as_the_default_loop_does():
    """``lm_study.config.optimizer``: fused Adam at ``cfg.lr`` (``fused_adam=False``: torch's default loop). Five
    steps of the tiny MoE with each end at the same parameters up to float rounding (as Adam shows it: below); a
    different lr does not (control)."""
    cfg = config.PRESETS["tiny"]
    variant = config.variants(cfg)["MoE"]
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(len(VOCAB), (4, cfg.block + 1), generator=gen) for _ in range(5)]

    def trained(c):
        model = config.build(c, variant, len(VOCAB), seed=0)
        opt = config.optimizer(c, model)
        for b in batches:
            loss = torch.nn.functional.cross_entropy(model(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            (loss + variant.aux_coef * collect_aux_loss(model, clear=True)).backward()
            opt.step()
        return opt, torch.cat([p.detach().flatten() for p in model.parameters()])

    fused_opt, fused = trained(cfg)
    loop_opt, loop = trained(dataclasses.replace(cfg, fused_adam=False))
    assert fused_opt.defaults["fused"] is True and not loop_opt.defaults["fused"]
    assert fused_opt.defaults["lr"] == cfg.lr
    # Float rounding, as Adam shows it: an element whose gradient is ~0 (rounding alone, e.g. the key bias) is
    # normalised by its own tiny scale, so it may move by a fraction of lr; every other element agrees to 1e-5.
    diff = (fused - loop).abs()
    assert diff.max() < cfg.lr and (diff > 1e-5).float().mean() < 0.01
    other = trained(dataclasses.replace(cfg, lr=cfg.lr * 1.5))[1]
    with pytest.raises(TypeError, match=r"StudyConfig\(fused_adam=...\): must be True or False, got 'yes'"):
        dataclasses.replace(cfg, fused_adam="yes")
    assert ((other - loop).abs() > 1e-5).float().mean() > 0.5            # a real change moves most of them
