"""labbook/reports/ch07.py: chapter 07's sentences, each from a results dict recorded from the executed chapter
(``RECORDED``, preset tiny) and from a copy where the verdict flips: the sentence must change with it."""
from __future__ import annotations

import copy

import pytest

from labbook.reports import ch07

RECORDED = {'preset': 'tiny',
     'world': 2,
     'cores': 2,
     'rtol': 1.3e-06,
     'atol': 5e-05,
     'ddp_worst': 2.9802322387695312e-08,
     'fsdp': {'shards': {'net1.weight': ('DTensor', (32, 50), (16, 50), '(Shard(dim=0),)'),
                         'net1.bias': ('DTensor', (32,), (16,), '(Shard(dim=0),)'),
                         'net2.weight': ('DTensor', (8, 32), (4, 32), '(Shard(dim=0),)'),
                         'net2.bias': ('DTensor', (8,), (4,), '(Shard(dim=0),)')},
              'offload_error': 'RuntimeError: Cannot access accelerator device when none is available.',
              'max_abs': {'SGD': [0.0, 0.0],
                          'SGD momentum': [0.0, 0.0],
                          'SGD momentum foreach': [0.0, 0.0],
                          'Adam': [0.0, 0.0],
                          'Adam fused': [0.0, 0.0],
                          'batch dim 1, Adam fused': [0.0, 0.0]},
              'ok': {'SGD': True,
                     'SGD momentum': True,
                     'SGD momentum foreach': True,
                     'Adam': True,
                     'Adam fused': True,
                     'batch dim 1, Adam fused': True}},
     'features': {"init_device_mesh('cpu'), fully_shard(mesh=...), uneven shards": ['works',
                                                                                    'rows per rank [3, 2] of 5; '
                                                                                    'full_tensor() == the unsharded '
                                                                                    'weight'],
                  'reduce-scatter / all-gather in bfloat16': ['works',
                                                              'reduce-scatter sum 3, all-gather of ranks [0, 1], in '
                                                              'bfloat16'],
                  'all_reduce with ReduceOp.AVG': ['works', 'AVG of 1..2 = 1.5'],
                  'MixedPrecisionPolicy(param_dtype=torch.bfloat16)': ['works',
                                                                       'forward in bfloat16; sharded parameters and '
                                                                       'their gradients stay float32'],
                  "init_device_mesh('cuda', ...)": ['skipped', 'no CUDA device on this machine'],
                  'Adam(fused=True), SGD(foreach=True) on DTensor shards': ['works', 'parity with DDP above'],
                  'CPUOffloadPolicy()': ['fails',
                                         'RuntimeError: Cannot access accelerator device when none is available.'],
                  'FSDP2-based replicate (replicate_with_fsdp)': ['works', 'parity in section 2']},
     'torch': '2.13.0',
     'moe_grads': {'naive DDP': {'ok': False,
                                 'rtol': 1e-05,
                                 'atol': 1e-05,
                                 'rows': [['experts.0.w2.bias', 0.0578225813806057, 2.3428771688936747],
                                          ['experts.0.w2.weight', 0.03485169417763245, 3.033762313152921],
                                          ['out.weight', 0.02212178334593773, 0.16254801828948048],
                                          ['experts.0.w1.weight', 0.022078383015468717, 2.9325130420590746]]},
                   'DDP init_sync=False': {'ok': False,
                                           'rtol': 1e-05,
                                           'atol': 1e-05,
                                           'rows': [['experts.0.w2.bias', 0.055747754871845245, 2.2771059339690716],
                                                    ['experts.0.w2.weight', 0.035103896330838325, 2.9274710232235157],
                                                    ['experts.0.w1.weight', 0.021186382742598653, 2.7018262746288784],
                                                    ['experts.0.w1.bias', 0.019069130765274167, 2.1270706897547638]]},
                   'grouped': {'ok': True,
                               'rtol': 1e-05,
                               'atol': 1e-05,
                               'rows': [['inp.weight', 2.2351741790771484e-08, 9.972908688887513e-08],
                                        ['out.weight', 1.4901161193847656e-08, 6.963218547599524e-08],
                                        ['out.bias', 1.4901161193847656e-08, 7.858309437629582e-08],
                                        ['inp.bias', 7.450580596923828e-09, 1.059332234352334e-07]]}},
     'ep_gap': {'before': 1.0, 'after': 0.0, 'after, broadcast off': 1.0},
     'costs': {2: {'threads': 1,
                   'memory': {'DDP': {'params': 7584, 'grads': 7584, 'adam moments': 15168, 'adam steps': 16},
                              'replicate': {'params': 7584, 'grads': 7584, 'adam moments': 15168, 'adam steps': 16},
                              'replicate (FSDP2)': {'params': 7584,
                                                    'grads': 7584,
                                                    'adam moments': 15168,
                                                    'adam steps': 16},
                              'fully_shard': {'params': 3792, 'grads': 3792, 'adam moments': 7584, 'adam steps': 16},
                              'MoE, experts replicated (DDP)': {'params': 2888,
                                                                'grads': 2888,
                                                                'adam moments': 5776,
                                                                'adam steps': 56},
                              'MoE, expert parallel (grouped)': {'params': 1768,
                                                                 'grads': 1768,
                                                                 'adam moments': 3536,
                                                                 'adam steps': 40}},
                   'minimum': {'DDP': 7584.0,
                               'replicate': 7584.0,
                               'replicate (FSDP2)': 7584.0,
                               'fully_shard': 11376.0,
                               'MoE, experts replicated (DDP)': None,
                               'MoE, expert parallel (grouped)': None},
                   'unsharded': {'net1': 6528, 'net2': 1056},
                   'collectives': {'tensor bytes': 16384,
                                   'all_reduce': {'sent': 16960, 'ring minimum': 16384.0},
                                   'all_gather': {'sent': 8480, 'ring minimum': 8192.0},
                                   'reduce_scatter': {'sent': 16960, 'ring minimum': 8192.0}},
                   'sent': {'DDP': 8160.0,
                            'replicate': 8160.0,
                            'replicate (FSDP2)': 8160.0,
                            'fully_shard': 17472.0,
                            'MoE, experts replicated (DDP)': 3464.0,
                            'MoE, expert parallel (grouped)': 2856.0},
                   'round_ms': {'DDP': [1.8394719991192687, 9.202953002386494, 8.369412000320153, 12.649641997995786,
                                        12.454222000087611],
                                'replicate': [1.5234900020004716, 8.07415800227318, 4.126947998884134,
                                              7.097109999449458, 6.429184999433346],
                                'replicate (FSDP2)': [3.678271998069249, 17.578442002559314, 16.18806099941139,
                                                      12.830581003072439, 13.274867000291124],
                                'fully_shard': [8.003593000466935, 44.59980300089228, 44.027778996678535,
                                                40.32125400044606, 38.66732400274486],
                                'MoE, experts replicated (DDP)': [20.75763899847516, 12.835559999075485,
                                                                  11.764456001401413, 12.415437002346152,
                                                                  12.234434001584304],
                                'MoE, expert parallel (grouped)': [37.33523000119021, 23.408207001921255,
                                                                   26.07741999963764, 20.58301000215579,
                                                                   21.914678000030108]},
                   'verdicts': {'fully_shard vs DDP': {'verdict': 'behind',
                                                       'p': 0.01644166774328368,
                                                       'ms': [35.123950600245735, 8.903140199981863],
                                                       'n': 5,
                                                       'ci': [7.42646127746184, 45.015159523065904]},
                                'expert parallel vs experts replicated': {'verdict': 'behind',
                                                                          'p': 0.012856634029947826,
                                                                          'ms': [25.863709000987, 14.001505200576503],
                                                                          'n': 5,
                                                                          'ci': [3.5072846301619798,
                                                                                 20.217122970659016]}},
                   'fully_shard predicted': 15701.25},
               4: {'threads': 1,
                   'memory': {'DDP': {'params': 7584, 'grads': 7584, 'adam moments': 15168, 'adam steps': 16},
                              'replicate': {'params': 7584, 'grads': 7584, 'adam moments': 15168, 'adam steps': 16},
                              'replicate (FSDP2)': {'params': 7584,
                                                    'grads': 7584,
                                                    'adam moments': 15168,
                                                    'adam steps': 16},
                              'fully_shard': {'params': 1896, 'grads': 1896, 'adam moments': 3792, 'adam steps': 16},
                              'MoE, experts replicated (DDP)': {'params': 5200,
                                                                'grads': 5200,
                                                                'adam moments': 10400,
                                                                'adam steps': 88},
                              'MoE, expert parallel (grouped)': {'params': 1840,
                                                                 'grads': 1840,
                                                                 'adam moments': 3680,
                                                                 'adam steps': 40}},
                   'minimum': {'DDP': 11376.0,
                               'replicate': 11376.0,
                               'replicate (FSDP2)': 11376.0,
                               'fully_shard': 17064.0,
                               'MoE, experts replicated (DDP)': None,
                               'MoE, expert parallel (grouped)': None},
                   'unsharded': {'net1': 6528, 'net2': 1056},
                   'collectives': {'tensor bytes': 16384,
                                   'all_reduce': {'sent': 26304, 'ring minimum': 24576.0},
                                   'all_gather': {'sent': 13152, 'ring minimum': 12288.0},
                                   'reduce_scatter': {'sent': 26304, 'ring minimum': 12288.0}},
                   'sent': {'DDP': 13104.0,
                            'replicate': 13104.0,
                            'replicate (FSDP2)': 13104.0,
                            'fully_shard': 29664.0,
                            'MoE, experts replicated (DDP)': 9528.0,
                            'MoE, expert parallel (grouped)': 6584.0},
                   'round_ms': {'DDP': [9.870647001662292, 66.96123700021417, 7.7390370024659205, 34.313454998482484,
                                        26.223148001008667],
                                'replicate': [12.67461200040998, 22.727414001565194, 15.433051998115843,
                                              43.32804799923906, 59.32426999788731],
                                'replicate (FSDP2)': [17.671563997282647, 37.33837199979462, 15.655323000828503,
                                                      57.579351003369084, 63.16717499794322],
                                'fully_shard': [42.72938899885048, 97.48022400162881, 138.5288040000887,
                                                42.696458996942965, 119.75995200191392],
                                'MoE, experts replicated (DDP)': [16.615131000435213, 81.39169100104482,
                                                                  36.56637400126783, 15.34707700193394,
                                                                  36.77925000010873],
                                'MoE, expert parallel (grouped)': [84.59116899757646, 99.73305699895718,
                                                                   32.355478000681615, 61.34505400041235,
                                                                   99.18520499923034]},
                   'verdicts': {'fully_shard vs DDP': {'verdict': 'behind',
                                                       'p': 0.03740077977127668,
                                                       'ms': [88.23896559988498, 29.021504800766706],
                                                       'n': 5,
                                                       'ci': [4.75022371935669, 113.68469787887986]},
                                'expert parallel vs experts replicated': {'verdict': 'inconclusive',
                                                                          'p': 0.061670949164524994,
                                                                          'ms': [75.44199259937159, 37.33990460095811],
                                                                          'n': 5,
                                                                          'ci': [-2.3622912511765293,
                                                                                 78.56646724800349]}},
                   'fully_shard predicted': 24351.75}},
     'record': {'date': '2026-11-25 14:10 UTC',
                'cores': 2,
                'verdicts': {'2': {'fully_shard vs DDP': {'verdict': 'behind',
                                                          'p': 0.017853615320193538,
                                                          'ms': [35.969662571428024, 4.941706285762848]},
                                   'expert parallel vs experts replicated': {'verdict': 'inconclusive',
                                                                             'p': 0.10833031125120919,
                                                                             'ms': [22.397270071483685,
                                                                                    12.027333785616586]}},
                             '4': {'fully_shard vs DDP': {'verdict': 'behind',
                                                          'p': 0.008245058514563605,
                                                          'ms': [108.93058285708841, 13.022567142830408]},
                                   'expert parallel vs experts replicated': {'verdict': 'inconclusive',
                                                                             'p': 0.13757985452553406,
                                                                             'ms': [50.28419799996949,
                                                                                    27.238619500037334]}}},
                'rows': 8,
                'differ': []},
     'trap_ms': {1: [3.91582099837251, 1.9550360011635348, 3.867394996632356],
                 2: [70.7577860011952, 84.04838199930964, 14.711980002175551]},
     'trap': {'verdict': 'inconclusive',
              'p': 0.1289096410441763,
              'ms': [56.506049334226795, 3.2460839987228005],
              'n': 3,
              'ci': [-38.03637157252308, 144.55630224353106]}}



def again():
    """A copy of the recorded dict to flip a verdict in."""
    return copy.deepcopy(RECORDED)


def test_feature_table_lists_every_row_with_its_status_and_flips_with_it():
    md = ch07.feature_table(RECORDED)
    assert md.startswith("| feature | CPU / gloo, torch 2.13.0 | seen |")
    assert "| CPUOffloadPolicy() | fails | RuntimeError: Cannot access accelerator device" in md
    assert "| all_reduce with ReduceOp.AVG | works | AVG of 1..2 = 1.5 |" in md
    R = again()
    R["features"]["all_reduce with ReduceOp.AVG"] = ["fails", "AVG of 1..2 = 3.0"]
    assert "| all_reduce with ReduceOp.AVG | fails | AVG of 1..2 = 3.0 |" in ch07.feature_table(R)


def test_fsdp_parity_prints_each_case_and_says_mismatch_when_a_case_fails():
    md = ch07.fsdp_parity(RECORDED)
    assert "Rank 0's parameters after `fully_shard` (2 ranks)" in md
    assert "| `net1.weight` | DTensor | (32, 50) | (16, 50) | (Shard(dim=0),) |" in md
    assert "| SGD momentum | 0.0e+00 | 0.0e+00 | OK |" in md and "MISMATCH" not in md
    R = again()
    R["fsdp"]["ok"]["SGD momentum"], R["fsdp"]["max_abs"]["SGD momentum"] = False, [0.0, 0.25]
    assert "| SGD momentum | 0.0e+00 | 2.5e-01 | MISMATCH |" in ch07.fsdp_parity(R)


def test_gradient_tables_say_ok_or_mismatch_per_method():
    md = ch07.gradient_tables(RECORDED)
    assert "**naive DDP**, rank 1: MISMATCH (rtol=1e-05, atol=1e-05)" in md
    assert "**grouped**, rank 1: OK" in md and "| `experts.0.w2.bias` | 5.78e-02 | 2.34e+00 |" in md
    R = again()
    R["moe_grads"]["grouped"]["ok"] = False
    assert "**grouped**, rank 1: MISMATCH" in ch07.gradient_tables(R)


def test_cost_table_carries_the_counted_numbers():
    md = ch07.cost_table(RECORDED)
    assert "**W = 2** ranks x 1 thread on 2 cores" in md and "**W = 4** ranks" in md
    assert "| DDP | 7,584 | 7,584 | 15,184 | 8,160 | 7,584 |" in md
    assert "| fully_shard | 1,896 | 1,896 | 3,808 | 29,664 | 17,064 |" in md
    assert "| MoE, expert parallel (grouped) | 1,768 | 1,768 | 3,576 | 2,856 | - |" in md
    assert "{'net1': 6528, 'net2': 1056} B" in md


def test_costs_verdict_follows_the_welch_verdicts():
    md = ch07.costs_verdict(RECORDED)
    assert "`fully_shard` saved memory at every W here and was faster at none." in md
    assert "between steps `fully_shard` holds 0.50 of DDP's parameters, gradients and Adam state per rank " \
           "(15,168 vs 30,336 B)" in md
    assert "its step is slower than DDP's: 35.12 vs 8.90 ms (mean of 5 round medians" in md
    assert "Expert parallelism holds 0.35 of the replicated MoE's parameters per rank and sends 0.69x its bytes" in md
    assert "(4 ranks on 2 cores (oversubscribed), 1 thread per rank)" in md
    R = again()
    R["costs"][2]["verdicts"]["fully_shard vs DDP"]["verdict"] = "ahead"
    R["costs"][4]["verdicts"]["expert parallel vs experts replicated"]["verdict"] = "behind"
    flipped = ch07.costs_verdict(R)
    assert "`fully_shard` was faster than DDP at W = [2]." in flipped and "faster at none" not in flipped
    assert "its step is faster than DDP's: 35.12" in flipped
    assert "its step is slower than the replicated one's: 75.44" in flipped
    assert "not distinguishable from the replicated one's: 75.44" in md


def test_record_comparison_counts_agreement_and_says_when_the_record_is_stale_or_missing():
    md = ch07.record_comparison(RECORDED)
    assert "| 2 | expert parallel vs experts replicated | behind (p = 0.013) | inconclusive (p = 0.11) | " \
           "**disagree** |" in md
    assert "The presets disagree on 1 of 4 step-time verdicts" in md
    assert "this run's equal the record's (memory exactly, bytes within 5%)." in md
    R = again()
    R["costs"][2]["verdicts"]["expert parallel vs experts replicated"]["verdict"] = "inconclusive"
    R["record"]["differ"] = [(2, "DDP", 7584, 7584, 17952.0, 8160.0)]
    flipped = ch07.record_comparison(R)
    assert "The two presets agree on every step-time verdict." in flipped and "disagree" not in flipped
    assert "this run's differ from the record's: [(2, 'DDP', 7584, 7584, 17952.0, 8160.0)]." in flipped
    R["record"] = None
    assert ch07.record_comparison(R).startswith("No full-preset record `data_parallel_costs_full.json`")


def test_collectives_explain_the_reduce_scatter_only_when_it_cost_an_all_reduce():
    md = ch07.collectives(RECORDED)
    assert "Preset tiny, one 16,384 B tensor:" in md
    assert "- W = 2: all_reduce sent 16,960 B (ring minimum 16,384)" in md
    assert "Predicted from these rates for `fully_shard` (two all-gathers and a reduce-scatter of 7,584 B): " \
           "15,701 B per step; counted: 17,472 B." in md
    assert "On gloo a reduce-scatter costs a whole all-reduce" in md and "1.11x and 1.22x the prediction" in md
    R = again()
    R["costs"][4]["collectives"]["reduce_scatter"]["sent"] = 13152
    flipped = ch07.collectives(R)
    assert "did not cost an all-reduce" in flipped and "costs a whole all-reduce" not in flipped


@pytest.mark.parametrize("verdict, words", [("inconclusive", "no difference this run could resolve (Welch p = 0.13)"),
                                            ("behind", "the oversubscribed run is slower (Welch p = 0.13)"),
                                            ("ahead", "here the extra threads were faster (Welch p = 0.13)")])
def test_trap_says_what_the_verdict_says(verdict, words):
    R = again()
    R["trap"]["verdict"] = verdict
    md = ch07.trap(R)
    assert md.startswith("DDP, 2 ranks on 2 cores, preset tiny: 2 threads per rank give a median step of 70.76 ms "
                         "[14.71-84.05], 1 thread per rank 3.87 ms [1.96-3.92]: ")
    assert words in md and md.endswith("the setting that cannot oversubscribe.")


def test_summary_states_parity_and_the_broadcast_only_when_they_held():
    md = ch07.summary(RECORDED)
    assert "the data-parallel model matched the local model (largest parameter difference 3.0e-08 for DDP, within " \
           "`rtol=1.3e-06, atol=5e-05`)" in md
    assert "made replicas that started 1 apart equal (gap 0); switched off, the gap stayed 1" in md
    assert "(`fully_shard` holds 0.25 of DDP's state per rank between steps at W = 4" in md and "2.26x its bytes" in md
    R = again()
    R["ddp_worst"], R["ep_gap"]["after"] = 0.1, 0.5
    flipped = ch07.summary(R)
    assert "did NOT match the local model (largest parameter difference 1.0e-01 for DDP, beyond" in flipped
    assert "0.5 apart after the wrap, and 1 with it switched off: the broadcast did not make them equal." in flipped


@pytest.mark.parametrize("fn, key", [(ch07.summary, "ep_gap"), (ch07.costs_verdict, "costs"), (ch07.trap, "trap_ms"),
                                     (ch07.record_comparison, "record"), (ch07.feature_table, "features")])
def test_a_missing_key_is_named(fn, key):
    R = again()
    del R[key]
    with pytest.raises(KeyError, match=key):
        fn(R)
