"""labbook/reports/ch09.py: chapter 09's sentences and tables, each from a results dict recorded from the executed
chapter (``RECORDED``, preset tiny, with the recorded full run) and from a copy where the verdict flips: the sentence
must change with it. ``OLD`` is what the chapter's older-record cell computes, run on today's record."""
from __future__ import annotations

import copy

import pytest

from labbook.reports import ch09

RECORDED = {'preset': 'tiny',
     'presets': {'tiny': {'d_model': 32,
                          'n_heads': 4,
                          'n_layers': 1,
                          'block': 32,
                          'batch': 16,
                          'steps': 48,
                          'eval_every': 16,
                          'seeds': [0, 1],
                          'lr': 0.006,
                          'bias_rate': 0.01},
                 'full': {'d_model': 64,
                          'n_heads': 4,
                          'n_layers': 2,
                          'block': 64,
                          'batch': 32,
                          'steps': 1000,
                          'eval_every': 250,
                          'seeds': [0, 1, 2],
                          'lr': 0.003,
                          'bias_rate': 0.001}},
     'bias': {'tokens': 256,
              'worst': 1.453125,
              'even': 1.0625,
              'odd': 1.453125,
              'move': 1.5000001192092896,
              'bound': 1.5},
     'zloss': {'before': 11.344145774841309, 'after': 5.610574245452881, 'steps': 30},
     'leaks': {'expert choice, c = 2': [2, 5, 6, 6, 3],
               'token choice, dropping cf = 1': [0, 1, 2, 0, 3],
               'token choice, dropless': [0, 0, 0, 0, 0]},
     'grouped_diff': 0.0,
     'pools': {'top-2/8, batch loss': {'routed': 8,
                                       'shared': 0,
                                       'width': 64,
                                       'k': 2,
                                       'total': 32768,
                                       'active': 8192,
                                       'combinations': 28},
               'fine-grained top-8/32': {'routed': 32,
                                         'shared': 0,
                                         'width': 16,
                                         'k': 8,
                                         'total': 32768,
                                         'active': 8192,
                                         'combinations': 10518300},
               'shared 1 + top-1/7': {'routed': 7,
                                      'shared': 1,
                                      'width': 64,
                                      'k': 1,
                                      'total': 32768,
                                      'active': 8192,
                                      'combinations': 7}},
     'train': {'steps': 48,
               'seeds': [0, 1],
               'last_step': 48,
               'window': 4,
               'rows': {'dense': {'val': 2.920790433883667,
                                  'val_std': 0.03668900206685066,
                                  'seconds': 0.5146346839992475,
                                  'val_prefix': 2.920790433883667,
                                  'val_prefix_std': 0.036689337342977524},
                        'top-2/8, no balancing': {'val': 2.938500165939331,
                                                  'val_std': 0.04837345704436302,
                                                  'seconds': 0.6797503640009381,
                                                  'val_prefix': 2.938500165939331,
                                                  'val_prefix_std': 0.04837311804294586,
                                                  'max_over_mean': 2.828125,
                                                  'batch_max_over_mean': 2.828125,
                                                  'batch_min_over_mean': 0.0029296875,
                                                  'entropy': 0.744717001914978,
                                                  'dropped': 0.0,
                                                  'logit_rms': 1.2783489227294922,
                                                  'lse2': 7.89919900894165},
                        'top-2/8, batch loss': {'val': 2.9345626831054688,
                                                'val_std': 0.05646396428346634,
                                                'seconds': 0.6841210559978208,
                                                'val_prefix': 2.9345626831054688,
                                                'val_prefix_std': 0.05646379664540291,
                                                'max_over_mean': 2.166015625,
                                                'batch_max_over_mean': 2.166015625,
                                                'batch_min_over_mean': 0.0693359375,
                                                'entropy': 0.880247950553894,
                                                'dropped': 0.0,
                                                'logit_rms': 0.9826233386993408,
                                                'lse2': 7.848691940307617},
                        'top-2/8, sequence loss': {'val': 2.9354195594787598,
                                                   'val_std': 0.054169658571481705,
                                                   'seconds': 0.7146428399992146,
                                                   'val_prefix': 2.935419797897339,
                                                   'val_prefix_std': 0.054169826209545135,
                                                   'max_over_mean': 2.2001953125,
                                                   'batch_max_over_mean': 2.2001953125,
                                                   'batch_min_over_mean': 0.0869140625,
                                                   'entropy': 0.8852777481079102,
                                                   'dropped': 0.0,
                                                   'logit_rms': 0.9617911577224731,
                                                   'lse2': 7.774610996246338},
                        'top-2/8, sigmoid, aux-free': {'val': 2.9130489826202393,
                                                       'val_std': 0.04892945662140846,
                                                       'seconds': 0.6629589359999954,
                                                       'val_prefix': 2.9130489826202393,
                                                       'val_prefix_std': 0.04892945662140846,
                                                       'max_over_mean': 1.4375,
                                                       'batch_max_over_mean': 1.568359375,
                                                       'batch_min_over_mean': 0.6494140625,
                                                       'entropy': 0.9841136336326599,
                                                       'dropped': 0.0,
                                                       'logit_rms': 1.0566601753234863,
                                                       'lse2': 4.724081039428711},
                        'top-2/8, batch loss + z-loss': {'val': 2.9391231536865234,
                                                         'val_std': 0.05666239187121391,
                                                         'seconds': 0.683500991000983,
                                                         'val_prefix': 2.9391231536865234,
                                                         'val_prefix_std': 0.05666239187121391,
                                                         'max_over_mean': 2.056640625,
                                                         'batch_max_over_mean': 2.072265625,
                                                         'batch_min_over_mean': 0.1083984375,
                                                         'entropy': 0.8995054960250854,
                                                         'dropped': 0.0,
                                                         'logit_rms': 0.9534828662872314,
                                                         'lse2': 4.162971019744873},
                        'fine-grained top-8/32': {'val': 2.9221439361572266,
                                                  'val_std': 0.07523009926080704,
                                                  'seconds': 0.9477289480000763,
                                                  'val_prefix': 2.9221434593200684,
                                                  'val_prefix_std': 0.07523027062416077,
                                                  'max_over_mean': 2.341796875,
                                                  'batch_max_over_mean': 2.3984375,
                                                  'batch_min_over_mean': 0.0390625,
                                                  'entropy': 0.9377861022949219,
                                                  'dropped': 0.0,
                                                  'logit_rms': 1.2044951915740967,
                                                  'lse2': 21.3431339263916},
                        'shared 1 + top-1/7': {'val': 2.926274061203003,
                                               'val_std': 0.021266963332891464,
                                               'seconds': 0.8711328099998354,
                                               'val_prefix': 2.926274061203003,
                                               'val_prefix_std': 0.021266963332891464,
                                               'max_over_mean': 1.372314453125,
                                               'batch_max_over_mean': 1.43212890625,
                                               'batch_min_over_mean': 0.57080078125,
                                               'entropy': 0.9835219383239746,
                                               'dropped': 0.0,
                                               'logit_rms': 1.022963523864746,
                                               'lse2': 6.801605224609375},
                        'expert choice, c=2': {'val': 2.940997838973999,
                                               'val_std': 0.06862720847129822,
                                               'seconds': 0.915585901499071,
                                               'val_prefix': 2.940913677215576,
                                               'val_prefix_std': 0.06622399389743805,
                                               'max_over_mean': 1.0,
                                               'batch_max_over_mean': 1.0,
                                               'batch_min_over_mean': 1.0,
                                               'entropy': 1.0,
                                               'dropped': 0.031168619791666668,
                                               'logit_rms': 1.1495168209075928,
                                               'lse2': 7.501542091369629},
                        'top-2/8, dropping cf=1': {'val': 2.9524197578430176,
                                                   'val_std': 0.060572437942028046,
                                                   'seconds': 0.8166079580005317,
                                                   'val_prefix': 2.9531261920928955,
                                                   'val_prefix_std': 0.0578237920999527,
                                                   'max_over_mean': 1.3620291948318481,
                                                   'batch_max_over_mean': 1.3626972436904907,
                                                   'batch_min_over_mean': 0.27532652020454407,
                                                   'entropy': 0.9417443871498108,
                                                   'dropped': 0.31010945638020837,
                                                   'logit_rms': 0.930012583732605,
                                                   'lse2': 7.4645466804504395}}},
     'record': {'path': 'benchmarks/results/modern_moe_full.json',
                'variants': 10,
                'seeds': 3,
                'steps': 1000,
                'jobs': 2,
                'minutes': 14.034888476499994,
                'stale': [],
                'lacks': []},
     'full': {'steps': 1000,
              'seeds': [0, 1, 2],
              'last_step': 1000,
              'variants': {'dense': {'final': [1.7144771814346313, 1.7321600914001465, 1.7053406238555908],
                                     'prefix': [1.714477138593793, 1.732160184532404, 1.7053404655307531],
                                     'gap': 1.5832483768463135e-07,
                                     'causal': True},
                           'top-2/8, no balancing': {'final': [1.7014625072479248, 1.670272946357727,
                                                               1.6694560050964355],
                                                     'prefix': [1.7014624904841185, 1.6702730190008879,
                                                                1.6694561056792736],
                                                     'gap': 1.0058283805847168e-07,
                                                     'causal': True,
                                                     'verdict': 'inconclusive',
                                                     'diff': -0.03692881266276049,
                                                     'p': 0.05289896770735703,
                                                     'holm': 0.1586969031220711,
                                                     'basis': 'final',
                                                     'sentence': 'top-2/8, no balancing vs dense: inconclusive (p = '
                                                                 '0.159 >= 0.05): 1.6804 vs 1.7173 nats (difference '
                                                                 '-0.0369, 95% CI [-0.0746, 0.0008], Welch (p '
                                                                 'Holm-adjusted over 9) t = -2.81, p = 0.159; 3 vs 3 '
                                                                 'seeds; preset full)'},
                           'top-2/8, batch loss': {'final': [1.6657103300094604, 1.6567862033843994,
                                                             1.6361550092697144],
                                                   'prefix': [1.6657104082405567, 1.6567860767245293,
                                                              1.6361548844724894],
                                                   'gap': 1.2665987014770508e-07,
                                                   'causal': True,
                                                   'verdict': 'ahead',
                                                   'diff': -0.06444211800893163,
                                                   'p': 0.005595339519447692,
                                                   'holm': 0.0403962251968756,
                                                   'basis': 'final',
                                                   'sentence': 'top-2/8, batch loss is ahead of dense: 1.6529 vs '
                                                               '1.7173 nats (difference -0.0644, 95% CI [-0.0973, '
                                                               '-0.0316], Welch (p Holm-adjusted over 9) t = -5.47, p '
                                                               '= 0.0404; 3 vs 3 seeds; preset full)'},
                           'top-2/8, sequence loss': {'final': [1.678642988204956, 1.6498444080352783,
                                                                1.6315698623657227],
                                                      'prefix': [1.6786430459469557, 1.6498444713652134,
                                                                 1.6315697617828846],
                                                      'gap': 1.0058283805847168e-07,
                                                      'causal': True,
                                                      'verdict': 'inconclusive',
                                                      'diff': -0.06397354602813721,
                                                      'p': 0.02413870638161565,
                                                      'holm': 0.0965548255264626,
                                                      'basis': 'final',
                                                      'sentence': 'top-2/8, sequence loss vs dense: inconclusive (p = '
                                                                  '0.0966 >= 0.05): 1.6534 vs 1.7173 nats (difference '
                                                                  '-0.0640, 95% CI [-0.1126, -0.0153], Welch (p '
                                                                  'Holm-adjusted over 9) t = -4.05, p = 0.0966; 3 vs 3 '
                                                                  'seeds; preset full)'},
                           'top-2/8, sigmoid, aux-free': {'final': [1.6997897624969482, 1.6543080806732178,
                                                                    1.6271538734436035],
                                                          'prefix': [1.6997895948588848, 1.6543081104755402,
                                                                     1.6271538380533457],
                                                          'gap': 1.6763806343078613e-07,
                                                          'causal': True,
                                                          'verdict': 'inconclusive',
                                                          'diff': -0.05690872669219971,
                                                          'p': 0.10150754446969563,
                                                          'holm': 0.20301508893939127,
                                                          'basis': 'final',
                                                          'sentence': 'top-2/8, sigmoid, aux-free vs dense: '
                                                                      'inconclusive (p = 0.203 >= 0.05): 1.6604 vs '
                                                                      '1.7173 nats (difference -0.0569, 95% CI '
                                                                      '[-0.1368, 0.0230], Welch (p Holm-adjusted over '
                                                                      '9) t = -2.52, p = 0.203; 3 vs 3 seeds; preset '
                                                                      'full)'},
                           'top-2/8, batch loss + z-loss': {'final': [1.6758111715316772, 1.6520044803619385,
                                                                      1.6592788696289062],
                                                            'prefix': [1.6758113596588373, 1.6520044226199389,
                                                                       1.6592787709087133],
                                                            'gap': 1.8812716007232666e-07,
                                                            'causal': True,
                                                            'verdict': 'ahead',
                                                            'diff': -0.05496112505594897,
                                                            'p': 0.006722743961586159,
                                                            'holm': 0.0403962251968756,
                                                            'basis': 'final',
                                                            'sentence': 'top-2/8, batch loss + z-loss is ahead of '
                                                                        'dense: 1.6624 vs 1.7173 nats (difference '
                                                                        '-0.0550, 95% CI [-0.0844, -0.0255], Welch (p '
                                                                        'Holm-adjusted over 9) t = -5.20, p = 0.0404; '
                                                                        '3 vs 3 seeds; preset full)'},
                           'fine-grained top-8/32': {'final': [1.6784697771072388, 1.6841564178466797,
                                                               1.7451696395874023],
                                                     'prefix': [1.678469691425562, 1.684156285598874,
                                                                1.7451696507632732],
                                                     'gap': 1.3224780559539795e-07,
                                                     'causal': True,
                                                     'verdict': 'inconclusive',
                                                     'diff': -0.014727354049682617,
                                                     'p': 0.571254831459606,
                                                     'holm': 0.571254831459606,
                                                     'basis': 'final',
                                                     'sentence': 'fine-grained top-8/32 vs dense: inconclusive (p = '
                                                                 '0.571 >= 0.05): 1.7026 vs 1.7173 nats (difference '
                                                                 '-0.0147, 95% CI [-0.0953, 0.0658], Welch (p '
                                                                 'Holm-adjusted over 9) t = -0.65, p = 0.571; 3 vs 3 '
                                                                 'seeds; preset full)'},
                           'shared 1 + top-1/7': {'final': [1.6567121744155884, 1.6392195224761963, 1.6480293273925781],
                                                  'prefix': [1.6567120254039764, 1.6392195895314217,
                                                             1.6480291690677404],
                                                  'gap': 1.5832483768463135e-07,
                                                  'causal': True,
                                                  'verdict': 'ahead',
                                                  'diff': -0.0693389574686687,
                                                  'p': 0.0032384301523389106,
                                                  'holm': 0.029145871371050194,
                                                  'basis': 'final',
                                                  'sentence': 'shared 1 + top-1/7 is ahead of dense: 1.6480 vs 1.7173 '
                                                              'nats (difference -0.0693, 95% CI [-0.0972, -0.0415], '
                                                              'Welch (p Holm-adjusted over 9) t = -7.41, p = 0.0291; 3 '
                                                              'vs 3 seeds; preset full)'},
                           'expert choice, c=2': {'final': [1.644829511642456, 1.6529042720794678, 1.6222021579742432],
                                                  'prefix': [1.6445161662995815, 1.6587898060679436,
                                                             1.6240921206772327],
                                                  'gap': 0.0058855339884757996,
                                                  'causal': False,
                                                  'verdict': 'ahead',
                                                  'diff': -0.07485993454853701,
                                                  'p': 0.00504952814960945,
                                                  'holm': 0.0403962251968756,
                                                  'basis': 'final_prefix',
                                                  'sentence': 'expert choice, c=2 is ahead of dense: 1.6425 vs 1.7173 '
                                                              'nats (difference -0.0749, 95% CI [-0.1112, -0.0385], '
                                                              'Welch (p Holm-adjusted over 9) t = -5.86, p = 0.0404; 3 '
                                                              'vs 3 seeds; preset full)'},
                           'top-2/8, dropping cf=1': {'final': [1.6544439792633057, 1.6515535116195679,
                                                                1.6489239931106567],
                                                      'prefix': [1.6605236548930407, 1.6519052647054195,
                                                                 1.6507165469229221],
                                                      'gap': 0.006079675629734993,
                                                      'causal': False,
                                                      'verdict': 'ahead',
                                                      'diff': -0.06294414338966225,
                                                      'p': 0.008037683610655228,
                                                      'holm': 0.0403962251968756,
                                                      'basis': 'final_prefix',
                                                      'sentence': 'top-2/8, dropping cf=1 is ahead of dense: 1.6544 vs '
                                                                  '1.7173 nats (difference -0.0629, 95% CI [-0.0923, '
                                                                  '-0.0335], Welch (p Holm-adjusted over 9) t = -7.44, '
                                                                  'p = 0.0404; 3 vs 3 seeds; preset full)'}},
              'balance': {'top-2/8, no balancing': {'batch': 1.2196776866912842,
                                                    'window': 1.2159863313039145,
                                                    'quietest': 0.2000943993528684},
                          'top-2/8, batch loss': {'batch': 0.2679589589436848,
                                                  'window': 0.22355790932973219,
                                                  'quietest': 0.729736328125},
                          'top-2/8, sequence loss': {'batch': 0.26314449310302734,
                                                     'window': 0.22167646884918213,
                                                     'quietest': 0.7411588629086813},
                          'top-2/8, sigmoid, aux-free': {'batch': 0.16842118899027514,
                                                         'window': 0.0407259464263916,
                                                         'quietest': 0.777490238348643},
                          'top-2/8, batch loss + z-loss': {'batch': 0.25172197818756104,
                                                           'window': 0.17612957954406738,
                                                           'quietest': 0.7510872284571329},
                          'fine-grained top-8/32': {'batch': 0.46512691179911303,
                                                    'window': 0.3992642958958943,
                                                    'quietest': 0.6049218773841858},
                          'shared 1 + top-1/7': {'batch': 0.31605470180511475,
                                                 'window': 0.1685123840967815,
                                                 'quietest': 0.7634830872217814},
                          'expert choice, c=2': {'batch': 0.0, 'window': 0.0, 'quietest': 1.0},
                          'top-2/8, dropping cf=1': {'batch': 0.06484806537628174,
                                                     'window': 0.06058677037556959,
                                                     'quietest': 0.8099141120910645}},
              'aux_tail': {'window_steps': 100, 'steps': 100, 'even': 1.152442, 'odd': 1.153592},
              'uncorrected_ahead': ['top-2/8, batch loss', 'top-2/8, sequence loss', 'top-2/8, batch loss + z-loss',
                                    'shared 1 + top-1/7', 'expert choice, c=2', 'top-2/8, dropping cf=1']}}

OLD = {'steps': 1000,
     'seeds': 3,
     'leaky': ['expert choice, c=2', 'top-2/8, dropping cf=1'],
     'comparisons': 9,
     'variants': {'dense': {'final': 1.7173259655634563,
                            'sd': 0.01363479532301426,
                            'holm': None,
                            'verdict': None,
                            'maxvio': float("nan")},
                  'top-2/8, no balancing': {'final': 1.6803971529006958,
                                            'sd': 0.018247704952955246,
                                            'holm': 0.1586969031220711,
                                            'verdict': 'inconclusive',
                                            'maxvio': 1.2159864902496338},
                  'top-2/8, batch loss': {'final': 1.6528838475545247,
                                          'sd': 0.01515917293727398,
                                          'holm': 0.039167376636133844,
                                          'verdict': 'ahead',
                                          'maxvio': 0.2235579490661621},
                  'top-2/8, sequence loss': {'final': 1.653352419535319,
                                             'sd': 0.02373182214796543,
                                             'holm': 0.0965548255264626,
                                             'verdict': 'inconclusive',
                                             'maxvio': 0.22167646884918213},
                  'top-2/8, sigmoid, aux-free': {'final': 1.6604172388712566,
                                                 'sd': 0.03670128807425499,
                                                 'holm': 0.20301508893939127,
                                                 'verdict': 'inconclusive',
                                                 'maxvio': 0.0407259464263916},
                  'top-2/8, batch loss + z-loss': {'final': 1.6623648405075073,
                                                   'sd': 0.012199673801660538,
                                                   'holm': 0.04033646376951695,
                                                   'verdict': 'ahead',
                                                   'maxvio': 0.17612957954406738},
                  'fine-grained top-8/32': {'final': 1.7025986115137737,
                                            'sd': 0.036977071315050125,
                                            'holm': 0.571254831459606,
                                            'verdict': 'inconclusive',
                                            'maxvio': 0.3992643356323242},
                  'shared 1 + top-1/7': {'final': 1.6479870080947876,
                                         'sd': 0.008746402338147163,
                                         'holm': 0.029145871371050194,
                                         'verdict': 'ahead',
                                         'maxvio': 0.16851234436035156},
                  'expert choice, c=2': {'final': 1.6399786472320557,
                                         'sd': 0.01591550000011921,
                                         'holm': 0.029145871371050194,
                                         'verdict': 'ahead',
                                         'maxvio': 0.0},
                  'top-2/8, dropping cf=1': {'final': 1.65164049466451,
                                             'sd': 0.002761020790785551,
                                             'holm': 0.057693420669624726,
                                             'verdict': 'inconclusive',
                                             'maxvio': 0.06058681011199951}}}


def again():
    """A copy of the recorded dict to flip a verdict in."""
    return copy.deepcopy(RECORDED)


def test_knob_table_documents_every_knob_of_both_presets():
    md = ch09.knob_table(RECORDED)
    assert set(ch09.KNOBS) == set(RECORDED["presets"]["tiny"]) == set(RECORDED["presets"]["full"])
    assert "| `steps` | 48 | 1000 | optimiser steps per run |" in md and "| `seeds` | [0, 1] | [0, 1, 2] |" in md
    R = again()
    R["presets"]["full"]["steps"] = 2000
    assert "| `steps` | 48 | 2000 |" in ch09.knob_table(R)


def test_pool_and_variant_tables_carry_the_counted_numbers():
    pools = ch09.pool_table(RECORDED)
    assert "| fine-grained top-8/32 | 32 | 0 | 16 | 8 | 10,518,300 | 32,768 | 8,192 |" in pools
    md = ch09.variant_table(RECORDED)
    assert md.startswith("Preset tiny: the last evaluation (step 48), mean ± std over seeds [0, 1];")
    assert "| dense | 2.9208 ± 0.0367 | 2.9208 ± 0.0367 | - | - | - | - |" in md
    assert "| expert choice, c=2 | 2.9410 ± 0.0686 | 2.9409 ± 0.0662 | 0.000 | 0.000 | 0.031 | 7.50 |" in md


def test_record_status_says_what_the_record_holds_or_lacks():
    md = ch09.record_status(RECORDED)
    assert "`benchmarks/results/modern_moe_full.json`: 10 variants x 3 seeds x 1000 steps, 2 side by side" in md
    assert "holds every evaluation, the prefix evaluations and the per-batch balance" in md
    R = again()
    R["record"]["lacks"] = ["final_prefix"]
    assert "predates the chapter's analysis: it lacks ['final_prefix']" in ch09.record_status(R)
    R["record"] = None
    assert ch09.record_status(R).startswith("⚠ **NO RECORDED FULL RUN**")


def test_record_and_balance_tables():
    md = ch09.record_table(RECORDED)
    assert "Last evaluation at step 1000; mean ± std over seeds [0, 1, 2]." in md
    assert "| shared 1 + top-1/7 | 1.6480 ± 0.0087 | 1.6480 ± 0.0087 | 1.6e-07 | yes | ahead (diff -0.0693, " \
           "p = 0.00324, Holm 0.0291) |" in md
    assert "| expert choice, c=2 | 1.6400 ± 0.0159 | 1.6425 ± 0.0174 | 5.9e-03 | NO | ahead (diff -0.0749, " \
           "p = 0.00505, Holm 0.0404, on prefixes) |" in md
    bal = ch09.balance_table(RECORDED)
    assert "| top-2/8, sigmoid, aux-free | 0.168 | 0.041 | 0.777 |" in bal
    assert "busiest/mean on even steps 1.152, odd steps 1.154." in bal


def test_full_run_counts_the_causal_variants_ahead_and_flips_with_a_verdict():
    md = ch09.full_run(RECORDED)
    assert "Of the 7 MoE variants evaluated causally, **3 are ahead of dense** by Welch's t-test, Holm-corrected " \
           "over the 9 comparisons with dense (α = 0.05) (`top-2/8, batch loss`, `top-2/8, batch loss + z-loss`, " \
           "`shared 1 + top-1/7`); the other 4 are inconclusive" in md
    assert "**expert choice, c=2** is not evaluated causally: its prefix evaluation differs from its full-forward " \
           "evaluation by up to 0.006 nats (full forward 1.6400, prefixes 1.6425)." in md
    assert "gives 6 of 9 ahead of dense" in md and "the windowed figure averages overloads away." in md
    R = again()
    R["full"]["variants"]["top-2/8, batch loss"]["verdict"] = "inconclusive"
    R["full"]["variants"]["fine-grained top-8/32"]["verdict"] = "behind"
    R["full"]["balance"]["top-2/8, sigmoid, aux-free"]["window"] = 0.5
    flipped = ch09.full_run(R)
    assert "**2 are ahead of dense**" in flipped and "; 1 behind (`fine-grained top-8/32`); the other 4" in flipped
    assert "here the windowed figure hides nothing." in flipped


def test_old_record_counts_only_causal_routings():
    R = {**again(), "full": None, "old": copy.deepcopy(OLD)}
    md = ch09.old_record(R)
    assert "Of the 7 MoE variants whose routing is causal, **3 are ahead of dense**" in md
    assert "`expert choice, c=2`, `top-2/8, dropping cf=1` are not counted" in md
    assert "| expert choice, c=2 | 1.6400 ± 0.0159 | ahead, Holm p = 0.0291 | 0.000 | leaks: not counted |" in md
    assert "| dense | 1.7173 ± 0.0136 |  | - | |" in md
    assert "3 of 7 MoE variants with causal routing ahead of dense" in ch09.summary(R)
    R["old"]["variants"]["top-2/8, batch loss"]["verdict"] = "inconclusive"
    assert "**2 are ahead of dense**" in ch09.old_record(R)


def test_summary_is_written_from_the_numbers_and_flips_with_them():
    md = ch09.summary(RECORDED)
    assert "to busiest/mean 1.45 at worst over the last 50 steps (even steps 1.06, odd 1.45), without a gradient;" in md
    assert "logit RMS from 11.3 to 5.6 in 30 steps; it lowers logit magnitude" in md
    assert "in 5 of 5 seeds with expert choice, 3 of 5 with a cf = 1 capacity cut, and 0 of 5 with dropless" in md
    assert "10,518,300 expert combinations against top-2 of 8's 28, at the same active and total expert parameters " \
           "(checked)." in md
    assert "span 2.913 to 2.952 nats with seed std up to 0.075" in md
    assert "Recorded full run: 3 of 7 causally evaluated MoE variants ahead of dense" in md
    R = again()
    R["bias"]["worst"], R["zloss"]["after"] = 3.9, 12.0
    R["leaks"]["token choice, dropless"] = [0, 2, 0, 0, 0]
    R["pools"]["fine-grained top-8/32"]["total"] = 36864
    flipped = ch09.summary(R)
    assert "without a gradient, still far from balanced;" in flipped and "it did not lower the logits here." in flipped
    assert "and 1 of 5 with dropless token choice." in flipped and "(NOT equal in this run)." in flipped


@pytest.mark.parametrize("fn, key", [(ch09.summary, "leaks"), (ch09.knob_table, "presets"),
                                     (ch09.variant_table, "train"), (ch09.full_run, "full"),
                                     (ch09.record_status, "record")])
def test_a_missing_key_is_named(fn, key):
    R = again()
    del R[key]
    with pytest.raises(KeyError, match=key):
        fn(R)
