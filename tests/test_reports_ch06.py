"""Chapter 06's report functions (labbook.reports.ch06): each on the results dict recorded from an executed chapter
(``RECORDED``, below; the token-exchange record trimmed to the fields the reports read), and on a copy where the
verdict flips: the sentence must change with it. A missing key is a KeyError naming it."""
from __future__ import annotations

import copy

import pytest

from labbook.reports import ch06

RECORDED = {
    'preset': 'tiny',
    'world': 8,
    'experts_per_rank': 2,
    'd_model': 16,
    'd_hidden': 32,
    'tokens': 48,
    'batch': 2,
    'seq_len': 8,
    'bug_steps': 60,
    'batches': [3, 8, 6, 4, 9, 7, 5, 3],
    'parity_worst': 1.9073486328125e-06,
    'zero_batches': [3, 0, 2, 4],
    'zero_worst': 4.76837158203125e-07,
    'received': [34, 101, 158, 110, 107, 115, 88, 55],
    'wire': [{'control': 6088, 'fixed': 6088, 'call': 14152, 'store': 0, 'closed': 0, 'calls': [14152, 14152, 14152],
            'routed': 8064}, {'control': 6088, 'fixed': 6088, 'call': 17416, 'store': 0, 'closed': 0, 'calls': [17416,
            17416, 17416], 'routed': 11328}, {'control': 6088, 'fixed': 6088, 'call': 20040, 'store': 0, 'closed': 0,
            'calls': [20040, 20040, 20040], 'routed': 13952}, {'control': 6088, 'fixed': 6088, 'call': 17224,
            'store': 0, 'closed': 0, 'calls': [17224, 17224, 17224], 'routed': 11136}, {'control': 6088, 'fixed': 6088,
            'call': 17672, 'store': 0, 'closed': 0, 'calls': [17672, 17672, 17672], 'routed': 11584}, {'control': 6088,
            'fixed': 6088, 'call': 17544, 'store': 0, 'closed': 0, 'calls': [17544, 17544, 17544], 'routed': 11456},
            {'control': 6088, 'fixed': 6088, 'call': 17096, 'store': 0, 'closed': 0, 'calls': [17096, 17096, 17096],
            'routed': 11008}, {'control': 6088, 'fixed': 6088, 'call': 14856, 'store': 0, 'closed': 0, 'calls': [14856,
            14856, 14856], 'routed': 8768}],
    'beyond_control': {'as written': 87296, 'with padding': 332800},
    'off_rows': 682,
    'dup_rows': 17,
    'per_choice': 43648,
    'dedup': 42560,
    'on_wire': 87296,
    'row_bytes': 64,
    'ds': {'cf 1.0': {'C': 6, 'bytes': 43008, 'dropped': 206, 'padding': 206}, 'cf 2.0': {'C': 12, 'bytes': 86016,
          'dropped': 16, 'padding': 784}, 'drop_tokens=False': {'C': 15, 'bytes': 107520, 'dropped': 0,
          'padding': 1152}},
    'experts': 16,
    'routed_rows': 768,
    'off_rank': [94, 86, 78, 80, 85, 80, 90, 89],
    'per_choice_rank': [6016, 5504, 4992, 5120, 5440, 5120, 5760, 5696],
    'dedup_rank': [5952, 5376, 4800, 4928, 5248, 5120, 5568, 5568],
    'bugs': [{'setting': 'EP = 2', 'bug': 'correct', 'final': 0.052111897617578506, 'vs_correct': 0.0, 'late': 1.0,
            'lower_steps': 0, 'steps': 60, 'failed': [], 'adam_failed': [], 'rel': 8.664129809458457e-08},
            {'setting': 'EP = 2', 'bug': 'experts x EP', 'final': 0.05211191624403, 'vs_correct': 3.574318407917332e-07,
            'late': 0.9999996296845728, 'lower_steps': 48, 'steps': 60, 'failed': ['experts'],
            'adam_failed': ['experts'], 'rel': 1.0}, {'setting': 'EP = 2', 'bug': 'router unreduced',
            'final': 0.05199532210826874, 'vs_correct': -0.0022370229187440582, 'late': 0.9747737788454156,
            'lower_steps': 33, 'steps': 60, 'failed': ['router'], 'adam_failed': ['router'], 'rel': 1.181042306368251},
            {'setting': 'EP = 2', 'bug': 'router twice', 'final': 0.0521119087934494,
            'vs_correct': 2.144591044750399e-07, 'late': 1.0, 'lower_steps': 17, 'steps': 60, 'failed': ['router'],
            'adam_failed': [], 'rel': 1.0}, {'setting': 'DP x EP = 2 x 2', 'bug': 'correct',
            'final': 0.048063021153211594, 'vs_correct': 0.0, 'late': 1.0, 'lower_steps': 0, 'steps': 60, 'failed': [],
            'adam_failed': [], 'rel': 1.6730051254185023e-07}, {'setting': 'DP x EP = 2 x 2', 'bug': 'DP mixes experts',
            'final': 0.03471171855926514, 'vs_correct': -0.27778741896782155, 'late': 1.1643419525809078,
            'lower_steps': 6, 'steps': 60, 'failed': ['experts'], 'adam_failed': ['experts'],
            'rel': 1.2187826850085541}],
    'router_rel': {12: 1.181042306368251, 96: 0.10551142666504985, 384: 0.14241460707140047},
    'exchange_allowance': 4640,
    'exchange': {'config': {'tokens': 48, 'k': 2, 'experts': 4}, 'worlds': {'2': {'fastmoe': {'sent_mean': 15576,
                'choices_dropped': 0, 'step_seconds': {'q1': 0.00727062149962876, 'median': 0.012444365998817375,
                'q3': 0.013424955499431235}}, 'ds drop': {'sent_mean': 13696, 'choices_dropped': 11,
                'step_seconds': {'q1': 0.007802026002536877, 'median': 0.007964606000314234,
                'q3': 0.00823229299930972}}, 'ds dropless': {'sent_mean': 15896, 'choices_dropped': 0,
                'step_seconds': {'q1': 0.00684981500126014, 'median': 0.008042401997954585,
                'q3': 0.010239990000627586}}, 'all-reduce': {'sent_mean': 14864, 'choices_dropped': 0,
                'step_seconds': {'q1': 0.0036251279998396058, 'median': 0.0038163930003065616,
                'q3': 0.006429018001654185}}}}},
    'exchange_record': {'config': {'experts': 16, 'k': 2, 'tokens': 256},
                       'worlds': {'2': {'fastmoe': {'sent_mean': 266552.0, 'choices_dropped': 0,
                       'step_seconds': {'q1': 0.008490382000218233, 'median': 0.011924776000341808,
                       'q3': 0.016127658499954123}}, 'ds drop': {'sent_mean': 267392.0, 'choices_dropped': 72,
                       'step_seconds': {'q1': 0.007219950000035169, 'median': 0.007822073999705026,
                       'q3': 0.008353190999969229}}, 'ds dropless': {'sent_mean': 439576.0, 'choices_dropped': 0,
                       'step_seconds': {'q1': 0.009745705999648635, 'median': 0.01070806999996421,
                       'q3': 0.012520615499852283}}, 'all-reduce': {'sent_mean': 268608.0, 'choices_dropped': 0,
                       'step_seconds': {'q1': 0.008897733000139851, 'median': 0.012455392999981996,
                       'q3': 0.014483105499948579}}}, '4': {'fastmoe': {'sent_mean': 403432.0, 'choices_dropped': 0,
                       'step_seconds': {'q1': 0.03313802750017203, 'median': 0.037273197999638796,
                       'q3': 0.04229119899946454}}, 'ds drop': {'sent_mean': 402816.0, 'choices_dropped': 165,
                       'step_seconds': {'q1': 0.021678040500319185, 'median': 0.023069467999448534,
                       'q3': 0.027054276500166452}}, 'ds dropless': {'sent_mean': 661092.0, 'choices_dropped': 0,
                       'step_seconds': {'q1': 0.02327827499993873, 'median': 0.026372448000074655,
                       'q3': 0.02850179400002162}}, 'all-reduce': {'sent_mean': 799584.0, 'choices_dropped': 0,
                       'step_seconds': {'q1': 0.029608239499793854, 'median': 0.0333989639993888,
                       'q3': 0.03479875450011605}}}, '8': {'fastmoe': {'sent_mean': 481896.0, 'choices_dropped': 0,
                       'step_seconds': {'q1': 0.08874136950043976, 'median': 0.09474230900013936,
                       'q3': 0.09941211750037837}}, 'ds drop': {'sent_mean': 473984.0, 'choices_dropped': 324,
                       'step_seconds': {'q1': 0.04319278699995266, 'median': 0.04672405200017238,
                       'q3': 0.05157017649980844}}, 'ds dropless': {'sent_mean': 775306.0, 'choices_dropped': 0,
                       'step_seconds': {'q1': 0.045364023000274756, 'median': 0.04760778800027765,
                       'q3': 0.05288147299961565}}, 'all-reduce': {'sent_mean': 1858416.0, 'choices_dropped': 0,
                       'step_seconds': {'q1': 0.09446294599956673, 'median': 0.10259956200025044,
                       'q3': 0.11314237949954986}}}}},
    'record_status': ('the record carries no code fingerprint (written before records carried one), so it is not '
                      "tied to today's code: its numbers may predate changes since"),
}


def flipped(**changes) -> dict:
    """A deep copy of RECORDED with top-level keys replaced."""
    return {**copy.deepcopy(RECORDED), **changes}


def test_receivers_names_the_busiest_rank_and_says_when_every_rank_is_even():
    text = ch06.receivers(RECORDED)
    assert "[34, 101, 158, 110, 107, 115, 88, 55]" in text and "busiest receiver (rank 2) gets 1.65x" in text
    assert "quietest 0.35x" in text and "(tiny preset)" in text
    even = ch06.receivers(flipped(received=[96] * 8))
    assert "busiest" not in even and "receive the same number of rows" in even


def test_wire_table_shows_every_repeat_and_the_routed_rows():
    table = ch06.wire_table(RECORDED)
    assert "| 2 | 6,088 | 6,088 | 20,040/20,040/20,040 | 13,952 | 13,952 |" in table
    assert len(table.splitlines()) == 2 + 8
    R = flipped()
    R["wire"][2]["calls"][1] += 1024                                         # one repeat sends more
    assert "| 20,040/21,064/20,040 |" in ch06.wire_table(R)


def test_two_minimums_says_which_minimum_the_wire_reached():
    text = ch06.two_minimums(RECORDED)
    assert "43,648 B per direction" in text and "42,560 B, because 17 of the 682 off-rank rows (2.5%)" in text
    assert "reaches the first" in text and "1,088 B per direction above" in text
    dedup = ch06.two_minimums(flipped(on_wire=2 * 42560))
    assert "reaches the second" in dedup and "reaches the first" not in dedup
    assert "neither minimum" in ch06.two_minimums(flipped(on_wire=2 * 50000))


def test_deepspeed_table_and_paragraph_follow_the_drops():
    table = ch06.ds_table(RECORDED)
    assert "| total | 682 | 43,648 | 42,560 | 43,008 | 86,016 | 107,520 |" in table
    assert "| 0 | 94 | 6,016 | 5,952 | 5,376 | 10,752 | 13,440 |" in table
    assert "capacity C per expert per rank: cf 1.0 6, cf 2.0 12, drop_tokens=False 15" in table
    assert "rows DeepSpeed drops, of 768: cf 1.0 206, cf 2.0 16, drop_tokens=False 0" in table
    text = ch06.deepspeed(RECORDED)
    assert "(C = 6) DeepSpeed sends 43,008 B, 0.99x the per-choice minimum" in text
    assert "drops 206 of 768 rows (27%) on busy experts while padding 206 slots" in text
    assert "C = 15 (the busiest rank-expert pair)" in text and "107,520 B (2.46x)" in text
    R = flipped()
    R["ds"]["cf 1.0"].update(dropped=0)
    assert "drops nothing, padding 206 slots" in ch06.deepspeed(R) and "on busy experts" not in ch06.deepspeed(R)
    assert "cf 1.0 0, cf 2.0 16" in ch06.ds_table(R)


def test_bug_table_and_lessons_follow_the_checks():
    table = ch06.bug_table(RECORDED)
    assert "| EP = 2 | router twice | 0.0521 | +0.0% | fails on router (rel 1.0e+00) | passes | 1.000 | 17 of 60 |" \
        in table
    assert "| DP x EP = 2 x 2 | DP mixes experts | 0.0347 | -27.8% |" in table and "median of steps 30-60" in table
    text = ch06.bug_lessons(RECORDED)
    assert "(tiny preset, 60 Adam steps)" in text and "0-16% away from the correct run's" in text
    assert "'router unreduced' even runs more than 1% lower" in text and "a relative 2e-07" in text
    assert "would hide a bug is 1.00" in text and "misses 'router twice'" in text
    R = flipped()
    for b in R["bugs"]:
        if b["bug"] == "router twice":
            b["adam_failed"] = ["router"]
        if b["bug"] == "router unreduced":
            b["late"] = 1.001
    text = ch06.bug_lessons(R)
    assert "catches them too" in text and "misses" not in text and "even run" not in text
    assert "| EP = 2 | router twice | 0.0521 | +0.0% | fails on router (rel 1.0e+00) | fails on router |" \
        in ch06.bug_table(R)


def test_exchange_verdicts_tie_or_fastest_and_the_record_as_context():
    live = ch06.exchange_verdicts(RECORDED["exchange"])
    assert live == ["W = 2: fewest bytes ds drop (14 kB per rank; all-reduce 1.09x, fastmoe 1.14x, ds dropless "
                    "1.16x); fastest all-reduce (3.8 ms); ds drop dropped 11 of 192 expert choices."]
    rec = ch06.exchange_verdicts(RECORDED["exchange_record"])
    assert [line[:8] for line in rec] == ["W = 2: f", "W = 4: f", "W = 8: f"]
    assert "fastest ds drop (7.8 ms)" in rec[0] and "ds drop and ds dropless tie on time" in rec[1]
    R = flipped()                                                            # the two fastest IQRs overlap: a tie
    R["exchange"]["worlds"]["2"]["all-reduce"]["step_seconds"].update(q3=0.0079)
    tie = ch06.exchange_verdicts(R["exchange"])[0]
    assert "all-reduce and ds drop tie on time (IQRs overlap: 3.8 vs 8.0 ms)" in tie and "fastest" not in tie
    text = ch06.exchange(RECORDED)
    assert text.startswith("This run (4 experts, 48 tokens per rank): W = 2: fewest bytes ds drop")
    assert "The record, as context (the record carries no code fingerprint" in text and "\n* W = 8: " in text


def test_summary_bullets_follow_the_results():
    text = ch06.summary(RECORDED)
    assert text.count("\n* ") == 5 and text.startswith("* (tiny preset) 8 gloo workers x 2 experts")
    assert "largest absolute difference 1.9e-06), with batch sizes [3, 8, 6, 4, 9, 7, 5, 3]" in text
    assert "87,296 B over all ranks" in text and "raised that to 332,800 B" in text
    assert "42,560 B (17 duplicate rows)" in text and "losses within 16% of the correct run's" in text
    assert "(experts x EP, router unreduced, router twice, DP mixes experts)" in text
    assert "43,008 B at cf 1.0 with 206 rows dropped" in text and "Recorded at W = 2, 4, 8 (16 experts" in text
    flat = ch06.summary(flipped(dup_rows=0, dedup=43648))
    assert "nothing to deduplicate" in flat and "duplicate rows" not in flat


@pytest.mark.parametrize("function, key", [
    (ch06.receivers, "received"), (ch06.wire_table, "wire"), (ch06.two_minimums, "dup_rows"),
    (ch06.ds_table, "off_rank"), (ch06.deepspeed, "routed_rows"), (ch06.bug_table, "bugs"),
    (ch06.bug_lessons, "bug_steps"), (ch06.exchange, "record_status"), (ch06.summary, "exchange_allowance"),
])
def test_a_missing_key_is_named(function, key):
    R = flipped()
    del R[key]
    with pytest.raises(KeyError, match=key):
        function(R)
