"""Three ways to move tokens to experts on other ranks, side by side on gloo: FastMoE's unpadded all-to-all,
DeepSpeed's padded capacity buffers (drop_tokens True and False) and Hugging Face's all-reduce of expert outputs.
(Chapter 06 reads the record.)

    .venv/bin/python benchmarks/token_exchange.py            # W = 2, 4, 8 -> benchmarks/results/token_exchange.json
    .venv/bin/python benchmarks/token_exchange.py --quick    # W = 2, small -> token_exchange_quick.json

For each world size and design (``labbook.token_exchange.run_design``, workers from ``labutils.launch``):
the largest output/gradient difference from one process holding every expert, the bytes each rank puts on the
wire per training step (forward, backward and the router's gradient reduction, one all_reduce), counted by the kernel
(``labutils.wire``), and the step time: per step the slowest rank, then the median and quartiles over steps.
All W workers share this machine's cores (W = 8 on 2 cores: 4 processes a core): the record says how many.

The verdict (issue 40: is the lab's FastMoE-style exchange at least as fast per step as DeepSpeed's?): per world
size one more launch times ``fastmoe`` and ``ds drop`` interleaved (``labbook.token_exchange.time_paired``: in each
round a block of steps of each, the order alternating), so each round gives a PAIR of medians (slowest rank per
step, median over the block) taken under the same load. A paired t-test over the rounds (``labutils.stats.paired``,
Holm over the world sizes) says "faster" or "slower" when the 95% interval of the mean difference excludes 0, and
"inconclusive" when it does not. ``uptime``'s load is printed and stored with the results: with more workers than
cores the times are mostly scheduling.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from labbook.perf.timing import machine_info, quartiles, save_result  # noqa: E402
from labbook.token_exchange import DESIGNS, run_design, time_paired  # noqa: E402
from labutils.launcher import launch  # noqa: E402
from labutils.stats import holm, paired  # noqa: E402

PRESETS = {"full": dict(worlds=[2, 4, 8], experts=16, d=64, h=128, k=2, tokens=256, steps=15, rounds=20,
                        round_steps=5),
           "quick": dict(worlds=[2], experts=4, d=16, h=32, k=2, tokens=32, steps=5, rounds=4, round_steps=3)}
PAIR = ("fastmoe", "ds drop")                 # the lab's exchange against DeepSpeed's (issue 40)


def uptime() -> str:
    """``uptime``'s line (the load averages), or why there is none."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"uptime unavailable ({exc})"


def summarize(per_rank: list) -> dict:
    """One design at one world size: worst parity error over ranks, bytes per rank, slowest-rank step times."""
    steps = len(per_rank[0]["seconds"])
    slowest = [max(r["seconds"][i] for r in per_rank) for i in range(steps)]
    q1, med, q3 = quartiles(slowest)
    return {"max_error": {k: max(r["errors"][k] for r in per_rank) for k in per_rank[0]["errors"]},
            "sent_per_rank": [r["sent_median"] for r in per_rank],
            "sent_mean": statistics.fmean(r["sent_median"] for r in per_rank),
            "step_seconds": {"q1": q1, "median": med, "q3": q3, "all": slowest},
            "tokens_without_output": sum(r["tokens_without_output"] for r in per_rank),
            "choices_dropped": sum(r["choices_dropped"] for r in per_rank)}


def paired_medians(per_rank: list) -> dict:
    """``time_paired``'s per-rank times -> each design's median per round (slowest rank per step first)."""
    out = {}
    for design in PAIR:
        rounds = per_rank[0][design]
        out[design] = [statistics.median(max(r[design][i][j] for r in per_rank) for j in range(len(rounds[i])))
                       for i in range(len(rounds))]
    return out


def verdict_line(world: str, comparison, medians: dict) -> str:
    """One world size's answer to "is fastmoe at least as fast as ds drop?", from the paired round medians."""
    a, b = PAIR
    (qa1, ma, qa3), (qb1, mb, qb3) = quartiles(medians[a]), quartiles(medians[b])
    lo, hi = comparison.ci
    answer = {"ahead": f"yes, {a} is faster", "behind": f"NO, {a} is slower",
              "inconclusive": "inconclusive (the difference's 95% CI includes 0"
                              + (f" after Holm over {comparison.family} world sizes" if comparison.family > 1 else "")
                              + ")"}[comparison.verdict]
    return (f"W={world}: is {a} at least as fast as {b}? {answer}: median of {len(medians[a])} paired rounds "
            f"{ma * 1e3:.1f} ms [IQR {qa1 * 1e3:.1f}-{qa3 * 1e3:.1f}] vs {mb * 1e3:.1f} ms [IQR {qb1 * 1e3:.1f}-"
            f"{qb3 * 1e3:.1f}]; mean paired difference {comparison.diff * 1e3:+.1f} ms, 95% CI [{lo * 1e3:+.1f}, "
            f"{hi * 1e3:+.1f}] ms, p = {comparison.p:.3g}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    cfg = PRESETS["quick" if args.quick else "full"]
    out = args.out or ROOT / "benchmarks" / "results" / ("token_exchange_quick.json" if args.quick
                                                         else "token_exchange.json")
    record = {"config": cfg, "machine": {**machine_info(), "uptime_start": uptime()}, "worlds": {}, "paired": {}}
    print("uptime:", record["machine"]["uptime_start"], flush=True)
    kw = {k: cfg[k] for k in ("experts", "d", "h", "k", "tokens", "steps")}
    pair_kw = {**{k: cfg[k] for k in ("experts", "d", "h", "k", "tokens", "rounds")}, "steps": cfg["round_steps"]}
    comparisons = {}
    for world in cfg["worlds"]:
        record["worlds"][str(world)] = {}
        for design in DESIGNS:
            res = summarize(launch(run_design, world, design, timeout=600, fn_kwargs=kw))
            record["worlds"][str(world)][design] = res
            print(f"W={world} {design:<12} sent/rank {res['sent_mean']:>10.0f} B   step median "
                  f"{res['step_seconds']['median'] * 1e3:7.1f} ms [IQR {res['step_seconds']['q1'] * 1e3:.1f}-"
                  f"{res['step_seconds']['q3'] * 1e3:.1f}]   max error {max(res['max_error'].values()):.1e}   "
                  f"choices dropped {res['choices_dropped']}", flush=True)
        medians = paired_medians(launch(time_paired, world, PAIR, timeout=600, fn_kwargs=pair_kw))
        comparisons[str(world)] = paired(medians[PAIR[0]], medians[PAIR[1]], names=PAIR, lower_is_better=True)
        record["paired"][str(world)] = {"round_medians": medians, "uptime": uptime()}
        print(f"W={world} paired rounds: {PAIR[0]} {statistics.median(medians[PAIR[0]]) * 1e3:.1f} ms, {PAIR[1]} "
              f"{statistics.median(medians[PAIR[1]]) * 1e3:.1f} ms (medians of round medians); uptime: "
              f"{record['paired'][str(world)]['uptime']}", flush=True)
    adjusted = holm(comparisons) if len(comparisons) > 1 else comparisons
    record["verdicts"] = {}
    print(f"verdict ({len(comparisons)} world size(s); per round the slowest rank's median step):")
    for world, c in adjusted.items():
        line = verdict_line(world, c, record["paired"][world]["round_medians"])
        record["paired"][world].update(verdict=c.verdict, diff_s=c.diff, ci_s=list(c.ci), p=c.p, p_raw=c.p_raw,
                                       family=c.family, test=c.test)
        record["verdicts"][world] = line
        print("  " + line)
    record["machine"]["load_avg_1min_end"] = machine_info()["load_avg_1min"]
    record["machine"]["uptime_end"] = uptime()
    print("uptime:", record["machine"]["uptime_end"])
    print("wrote", save_result(record, out, ROOT))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
