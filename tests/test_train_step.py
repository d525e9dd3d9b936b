"""Issue 26: the training-step cuts in the MoE core leave every number where HEAD's code put it, and
``benchmarks/train_step.py`` measures what it names.

``HEAD_FINGERPRINTS`` were printed by this file's own :func:`fingerprints` run against the core as it was before
the cuts (commit 91a9a94, ``git archive 91a9a94 labutils``): per tensor (logits and every gradient of step 0, the
loss of 3 steps, every parameter after 3 Adam steps) its float64 l2 norm and its dot with fixed random weights.
On the recording machine the cut code reproduced them bit for bit; the router's matmul layout
(``labutils.moe.gates.router_logits``, a later cut) changes float rounding only, which the test allows. The
updated parameters leave out the key bias (:func:`without_key_bias`: its gradient is rounding alone).
"""
from __future__ import annotations

import math
import pathlib
import sys

import pytest
import torch

from labutils.models import CharLM, make_ffn
from labutils.moe import NaiveGate, NoisyGate
from labutils.moe.gates import _std_normal_cdf, collect_aux_loss
from labutils.train import lm_cross_entropy

CASES = {"noisy gate, fused experts": (NoisyGate, None),        # chapter 05's MoE: ExpertMLPs
         "naive gate, FMoELinear loop": (NaiveGate, "relu")}     # a non-fusable activation: _Expert / MOELinear


def seeded_steps(name: str, steps: int = 3) -> list:
    """Every tensor a training step produces (logits and gradients of step 0, the loss of every step, the
    parameters after the last Adam step) for a small seeded CharLM with an MoE feed-forward."""
    gate, act = CASES[name]
    torch.manual_seed(0)
    kw = {} if act is None else {"activation": lambda t: torch.relu(t)}
    model = CharLM(40, 32, 4, 2, 16, ffn=lambda: make_ffn("fmoe", 32, 64, num_expert=4, top_k=2, gate=gate, **kw))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(1)
    out = []
    for step in range(steps):
        x = torch.randint(40, (8, 16), generator=data)                  # (B, T)
        logits = model(x)                                               # (B, T, vocab)
        loss = lm_cross_entropy(logits, x) + 0.01 * collect_aux_loss(model, clear=True)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step == 0:
            out += [logits.detach()] + [torch.as_tensor(p.grad).clone() for p in model.parameters()]
        out.append(loss.detach())
        opt.step()
    return out + [without_key_bias(n, p.detach().clone()) for n, p in model.named_parameters()]


def without_key_bias(name: str, p: torch.Tensor) -> torch.Tensor:
    """An updated parameter, less the key third of a fused ``qkv`` bias. That bias's true gradient is exactly 0
    (it adds ``q . b_k`` to all of a query's scores alike, and softmax ignores a shared shift), so its computed
    gradient is pure float rounding, and Adam, which divides by the gradient's own scale, turns that rounding into
    steps of about ``lr``: any re-ordering of a sum anywhere moves those 2 x 32 numbers by ~1e-3."""
    if not name.endswith("attn.qkv.bias"):
        return p
    q, _, v = p.chunk(3)
    return torch.cat([q, v])


def fingerprint(t: torch.Tensor) -> tuple:
    """(l2 norm, dot with fixed random weights) in float64: any change beyond float rounding moves one."""
    v = t.detach().double().flatten()
    w = torch.randn(v.numel(), generator=torch.Generator().manual_seed(v.numel()), dtype=torch.float64)
    return float(v.norm()), float(v @ w)


def fingerprints(name: str) -> list:
    """Recorded with 1 torch thread (as the study runs): more threads change reductions' rounding, and Adam
    magnifies that in near-zero gradients."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [f for t in seeded_steps(name) for f in fingerprint(t)]
    finally:
        torch.set_num_threads(threads)


HEAD_FINGERPRINTS = {
    'noisy gate, fused experts': [
        42.9221609158181, 38.427839163608795, 0.06820878732882062, -0.11374357589183405,
        0.03344034906275857, -0.04027791763943261, 0.007201470183637234, 0.0023240569474313804,
        0.014152495214361887, 0.0023799305818788747, 0.0675366898855398, 0.13133891399240327,
        0.021795762151385713, 0.0600347436577137, 0.06907560755223273, 0.04555596096088743,
        0.036613216402862185, 0.016001460292342694, 0.010044935523718093, 0.004641857488082433,
        0.010019997036285016, 0.009583072702428742, 0.033823649667103266, -0.03669955086466236,
        0.005246678781524879, -0.002849253691337124, 0.04951483225956827, -0.007521032445875559,
        0.016691767783667436, 0.005780842236284389, 0.029465218703520823, 0.018573688467270835,
        0.004359232572857047, -0.005145890899980948, 0.03977381337141406, -0.02973405638041232,
        0.014262418435397207, -0.010886870691820504, 0.04307512678350201, -0.008275368202889086,
        0.0073858690102433355, -0.012454198375368585, 0.06113313007827259, 0.03255463524961237,
        0.0170603584678005, 0.0014476966752817958, 0.04279437594782834, 0.048154628768598204,
        0.007250045133085151, -0.013992849771303703, 0.055216962540944735, 0.06572171658018479,
        0.020271957506779202, 0.012674423156941705, 0.019765654849045133, 0.038626823796400866,
        0.006457410407289909, 0.010782735764564236, 0.006972450862564607, -0.010198100820088625,
        0.012668223702549745, -0.005981337726280654, 0.0639464954579164, -0.017805348840348394,
        0.019891668405126208, 0.034141101732847734, 0.07225535632931203, 0.08895382634312643,
        0.03361402304071582, 0.011994684395101044, 0.010399285481666559, 0.01202819448795378,
        0.013532162117920384, -0.011689398322812482, 0.026678918627513, -0.04092755906773084,
        0.00445799208902646, 0.0046739099368096355, 0.03691080423790692, 0.05482653229865575,
        0.012088371961845677, 0.013847943892328603, 0.03451219323699305, 0.08350578686266905,
        0.006042051320532416, 0.005904618725838864, 0.048163485279400946, 0.00797096426455884,
        0.01729990066827353, -0.00027454446737632844, 0.04793047555867148, 0.06789830086645236,
        0.009833869507673103, 0.002503401076813463, 0.061788703647102775, -0.026040868208216578,
        0.02595614362379788, 0.0036353892198532477, 0.039404274235142166, 0.026227157832518885,
        0.006828600721699037, -0.005689548220744547, 0.052788908738776556, -0.04903100790878939,
        0.020571259187336686, 0.0022354632807734115, 0.021100326882162814, -0.0033735212519228966,
        0.006412963813379186, -0.0038524314973312594, 0.09479743491733168, 0.039143039739136756,
        0.040063296934276675, 0.019578477068296515, 0.7781723168211436, 0.14225566389359023,
        0.08381625849298616, 0.029941387288826546, 3.826045274734497, 2.530363350972527,
        3.7448782920837402, 2.476683390736628, 3.668806314468384, 2.426373023145053,
        36.80063328334078, -11.991949596932976, 23.082264483858616, 34.02654006474111,
        5.654645380384408, -1.1169967223589556, 0.03701638555688389, 0.024428016665495912,
        5.64424137790803, 1.196276516977227, 0.8503720421227917, -1.2992597598825115,
        3.238435511753544, -1.7124391487810826, 0.6454379795770538, -0.5737160522567586,
        5.6631467338412405, -1.1235151962724976, 0.03542756195426272, -0.0493185716917434,
        4.551456274467586, 4.906528781469519, 0.047926535845589424, 0.01879385535925792,
        3.3111685978453855, -5.036481653385317, 0.034253336594629265, -0.01577345409992578,
        4.62615923506651, -0.9941363797188192, 0.05079154714445954, 0.013151654613323288,
        3.2135886417343396, -7.745920298485225, 0.0385194457212123, 0.02997811438036915,
        4.611303495949515, 0.3466026596631404, 0.04976654989622881, 0.08245003864318981,
        3.2676194904134053, -2.845176545832437, 0.03298409231995666, -0.0010423148299349583,
        4.668609199954595, 3.8678773083760682, 0.05018433122771056, 0.07416584941813846,
        3.2399087694876862, -3.0384711543422487, 0.03549089143018448, -0.029458342903722966,
        3.3634715836595936, 1.9212104205926281, 3.4217607409393755, 1.6029584554587528,
        5.656972245191913, -1.0551088761704959, 0.027115616013023314, 0.007661114198496984,
        5.681284650372822, 1.8608451883794261, 0.8414598433426231, 1.0055637437704221,
        3.3282992031751424, -2.3445143449413024, 0.5969234887447051, -1.315539817220712,
        5.664960040292245, -1.1512191412443022, 0.03848251215297406, 0.029744602450072054,
        4.554482659690903, -3.3762810299010297, 0.05497445791541574, -0.07708996865459872,
        3.229773552252753, -4.264342280914159, 0.038638357427161076, -0.06340592126229559,
        4.612436760072167, 0.9419949411163924, 0.05352084118255219, -0.007166094303083497,
        3.3297617762527243, 4.081189642604926, 0.03489764620607643, -0.0033949713596021346,
        4.565231403360704, 1.9333089685289426, 0.05492070520204786, -0.01303648147467499,
        3.295648993845565, -4.494742782976192, 0.0400553821891047, -0.0013646363367993478,
        4.644503992962498, -3.333458573021465, 0.04937188708304008, 0.09297384716917306,
        3.2465406607055485, -2.4343552683300684, 0.03605643839792692, -0.0069119795079882855,
        3.3083373192438734, 0.21322015143172074, 3.3051455787162944, 2.680660278259464,
        5.640444068444984, -1.1181740520068049, 0.02633534304990726, -0.030885242907826738,
        3.591911610619158, 2.4896274182270277, 0.6615506858739303, -0.5859826603214147,
    ],
    'naive gate, FMoELinear loop': [
        42.46041587011862, 41.86845821842637, 0.07146291669111089, 0.22152925791089062,
        0.03727470572884132, 0.01102556611570108, 0.006214342416135253, 0.003922398469203779,
        0.009406857686157672, 0.007698151813000197, 0.0647448837372901, -0.05225977210820615,
        0.016882508891783582, -0.0007882214345183193, 0.064510591072396, -0.026083903362786227,
        0.035393745420503823, -0.018144062043256637, 0.008131788949562678, -0.0006541529808154357,
        0.00803886932151716, -0.0031669305654182193, 0.03901530829920885, -0.009916988122182257,
        0.005738862874106078, -0.004706229096495446, 0.056568201487013865, -0.0003791034018686412,
        0.016421554100857622, -0.002880959763269835, 0.023817569671847345, -0.020193107734865906,
        0.0041639509498992144, -0.0024240637726957123, 0.03396413376160746, -0.04652473204615909,
        0.01039272405255272, -0.013646728968167154, 0.04247501604649474, 0.02180887027869454,
        0.007793915649249535, -0.01318723071719439, 0.07054000554512642, 0.013277094143540155,
        0.021926253653311793, -0.0013178628711815504, 0.04408627856284041, 0.012768638741951235,
        0.006166341519849428, -0.0003828169123215985, 0.06587054513857966, 0.00943339275304595,
        0.020451185405596626, 0.002505754957284871, 0.02359226958001386, 0.027569765437032972,
        0.0025747895230476487, -0.005174763913403141, 0.007049007429366904, 0.011858992723373159,
        0.009732447365144722, -0.0005351113200663948, 0.07423238769140202, 0.02618730434978799,
        0.02050007681824118, 0.026898125761100615, 0.06463839292236141, -0.04327568993488698,
        0.03676133202499037, -0.016002933580213454, 0.008452809830500545, -0.004884120467453016,
        0.006098174239440859, -0.0055694475240427865, 0.036085452212027684, -0.026872735706790905,
        0.005944981352927569, 0.017390686756134886, 0.05105769391383837, 0.03434256537408807,
        0.014414718555514515, -0.006244502127199536, 0.036720220733963756, -0.005794278445201025,
        0.006342849985767549, -0.003779288348855993, 0.0544543760880288, -0.02429463094037875,
        0.016679487623094433, -0.015719303241050996, 0.034874779422251714, 0.04823677622718107,
        0.005781299817854338, -0.007603489788731152, 0.053717375527258415, -0.0055401994938897685,
        0.01507704271522703, 0.004409367567903709, 0.040783797378356156, -0.028962624921955678,
        0.006807132861903492, 0.0049639081386378126, 0.06201221012839825, 0.04396998218396065,
        0.018438202080121098, 0.004058664844446457, 0.027549522153669417, 0.02936073283637022,
        0.0027653754403980713, 0.0018143081090649272, 0.0956760551084041, -0.009569521487838371,
        0.049542148119114844, -0.013953638244467517, 0.7855913842569405, -0.7391413098654527,
        0.08497801350590789, 0.03568202072892681, 3.8003673553466797, 2.5133812032239833,
        3.5891337394714355, 2.3736813926562115, 3.6286864280700684, 2.3998396491523675,
        36.800607095295376, -13.05850894277582, 23.089748094839145, 33.983182402161646,
        5.643676620570346, -1.1144423453055523, 0.028478378662601042, 0.02750317902323764,
        5.638371818892601, -3.2233214367434546, 0.7834220670202238, 0.5525653581853981,
        3.237574704603811, -0.41810639738421207, 0.6274019034380026, 0.44369299221575026,
        5.6672067251247, -1.1018709386253094, 0.03551666445846365, 0.0229100162962346,
        4.576621736408721, 3.0455018955978215, 0.05244042022101643, -0.05827573012697562,
        3.299817632533565, 0.17238003420250525, 0.03745930926035731, -0.03885705314990434,
        4.6238262738943545, -1.0932948291934323, 0.051507683864137864, 0.02610955699454441,
        3.2097022313206622, -2.4717230705746394, 0.03693839272538259, 0.03305276409217715,
        4.630615619907065, 0.9815989408884058, 0.05092902594299161, 0.0535078247331473,
        3.266522471987511, -3.195526950821618, 0.036787392443127565, -5.6779575138462754e-05,
        4.668033906180969, -1.8768182853584472, 0.05785933757014107, 0.03446761296647366,
        3.2538844087707273, 1.0261431999404609, 0.04167140205563015, 0.010943421950776577,
        1.1896207390056412, 0.6393616665861914, 0.2738737031107609, 0.31628545802778485,
        5.654128705591977, -1.135798387532682, 0.03213984935565377, -0.00744038285986862,
        5.658247491967646, -3.237390962048241, 0.7826743901703385, 1.8649023151017725,
        3.3796491082095823, -4.779772384718858, 0.5436648356356194, -0.44751637034078684,
        5.674570595120305, -1.1103144238630795, 0.03568830342729765, 0.050531717920575966,
        4.559534600496661, -4.09178271848186, 0.05152465106394798, -0.07605526652132119,
        3.2511478946047205, -3.903521942132633, 0.039763706555808444, -0.014302610518421268,
        4.608035905711943, 3.4023147765912403, 0.05480800527447336, 0.08982383889384912,
        3.3200077636914385, 0.4818024255213347, 0.03879739703369694, 0.015009217343312741,
        4.59523886293422, -4.1549001054027075, 0.05311431373115331, -0.022906432129341788,
        3.315223334732054, -0.780252970664717, 0.03938964127302974, -0.04285279332862044,
        4.619931301058952, -2.459365124826181, 0.05160018036924891, 0.0636241251505761,
        3.2663781389472915, 2.2663426483312206, 0.037558943423358984, 0.00012367904071968307,
        1.1880442474848112, -1.9039363994257643, 0.20155475455480867, 0.28829347434867086,
        5.647519607189088, -1.0942376333410548, 0.02515877473821966, -0.01795859858455483,
        3.6114362024328646, -14.029541648658263, 0.6791784094744268, -0.8569029842760314,
    ],
}


def close(a: float, b: float, scale: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6 * scale)


def mismatches(live: list, recorded: list) -> list:
    """Indices of tensors whose (norm, dot) differ from the record beyond float rounding."""
    assert len(live) == len(recorded), f"{len(live)} fingerprint values, {len(recorded)} recorded"
    bad = []
    for i in range(0, len(live), 2):
        norm, ref_norm = live[i], recorded[i]
        if not (close(norm, ref_norm, ref_norm) and close(live[i + 1], recorded[i + 1], ref_norm + 1e-30)):
            bad.append(i // 2)
    return bad


@pytest.mark.parametrize("name", list(CASES))
def test_training_steps_match_head(name):
    """Outputs, losses, every gradient and every updated parameter are HEAD's (up to float rounding)."""
    assert mismatches(fingerprints(name), HEAD_FINGERPRINTS[name]) == []


def test_fingerprints_catch_a_small_change():
    """Negative control: one gradient element (the largest) off by 1% of itself: the comparison flags it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tensors = seeded_steps("noisy gate, fused experts")
    finally:
        torch.set_num_threads(threads)
    live = [f for t in tensors for f in fingerprint(t)]
    assert mismatches(live, HEAD_FINGERPRINTS["noisy gate, fused experts"]) == []
    grad = tensors[5].clone()                                            # a gradient of step 0
    grad.view(-1)[grad.abs().argmax()] *= 1 + 1e-2
    changed = live[:10] + list(fingerprint(grad)) + live[12:]
    assert mismatches(changed, HEAD_FINGERPRINTS["noisy gate, fused experts"]) == [5]


def test_std_normal_cdf_is_torch_distributions_bit_for_bit():
    z = torch.randn(4096, generator=torch.Generator().manual_seed(0), dtype=torch.float32) * 4  # (n,)
    a, b = z.clone().requires_grad_(), z.clone().requires_grad_()
    mine = _std_normal_cdf(a)
    theirs = torch.distributions.Normal(torch.zeros(()), torch.ones(())).cdf(b)
    assert torch.equal(mine, theirs)
    g = torch.rand(4096, generator=torch.Generator().manual_seed(1))
    mine.backward(g)
    theirs.backward(g)
    assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)


def test_prob_in_top_k_one_cdf_equals_two():
    """The load estimate with one cdf over the chosen threshold equals the paper's two-cdf ``where``, values and
    gradients (to clean, stddev and both thresholds), bit for bit."""
    gen = torch.Generator().manual_seed(0)
    gate = NoisyGate(16, 8, top_k=2)
    T, E = 512, 8
    clean = torch.randn(T, E, generator=gen)
    stddev = torch.rand(T, E, generator=gen) + 0.01
    noisy = clean + torch.randn(T, E, generator=gen) * stddev
    top = noisy.topk(3, dim=-1).values
    normal = torch.distributions.Normal(torch.zeros(()), torch.ones(()))

    def two_cdfs(c, s, t):                                               # Shazeer et al. eq. 9 as written
        is_in = noisy > t[:, 2:3]
        return torch.where(is_in, normal.cdf((c - t[:, 2:3]) / s), normal.cdf((c - t[:, 1:2]) / s))

    leaves = [[v.clone().requires_grad_() for v in (clean, stddev, top)] for _ in range(2)]
    mine = gate._prob_in_top_k(leaves[0][0], noisy, leaves[0][1], leaves[0][2])
    ref = two_cdfs(*leaves[1])
    assert torch.equal(mine, ref)
    g = torch.randn(T, E, generator=gen)
    mine.backward(g)
    ref.backward(g)
    for a, b in zip(*leaves):
        assert torch.equal(a.grad, b.grad)
    # negative control: the in/out thresholds swapped is a different estimate
    swapped = gate._prob_in_top_k(clean, noisy, stddev, top[:, [0, 2, 1]])
    assert not torch.equal(swapped, ref.detach())


def test_noisy_gate_forward_is_its_named_pieces():
    """``NoisyGate.forward`` = router -> top-k -> balance loss (the pieces the benchmark times)."""
    gate = NoisyGate(16, 8, top_k=2)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))  # (T, d)
    torch.manual_seed(3)
    idx, score = gate(x)
    loss = gate.get_loss()
    torch.manual_seed(3)
    clean, logits, stddev = gate.noisy_logits(x)
    top, idx2, score2 = gate.top_k_choice(logits)
    assert torch.equal(idx, idx2.reshape(-1)) and torch.equal(score, score2.unsqueeze(1))
    assert loss is not None and torch.equal(loss, gate.balance_loss(clean, logits, stddev, top, idx2, score2))
    gate.eval()
    clean, logits, stddev = gate.noisy_logits(x)
    assert stddev is None and logits is clean


def _tiny_runs():
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import train_step

    from labbook.lm_study import config
    from labutils.data import CharBatches

    cfg = config.PRESETS["tiny"]
    text = torch.randint(40, (4096,), generator=torch.Generator().manual_seed(0))

    class Corpus:
        vocab_size, train = 40, text

    def fresh():
        _, opt, step, variant, _ = built = train_step.setup(cfg, "MoE", Corpus)
        return built
    return train_step, cfg, fresh, CharBatches


def test_benchmark_phases_are_timed_inside_real_steps_and_change_nothing():
    """Every MoE phase gets a forward and (where differentiable) a backward time from inside a real step; the
    instrumented step leaves the same parameters as the study's own step; the wrappers are removed after."""
    from labutils.moe.gates import NoisyGate

    train_step, cfg, fresh, _ = _tiny_runs()
    original = NoisyGate.noisy_logits
    model_a, opt_a, _, variant, data_a = fresh()
    phases = train_step.instrumented_steps(model_a, opt_a, data_a, variant, steps=2)
    assert NoisyGate.noisy_logits is original
    for phase in ("router", "top-k", "aux loss", "sort/count", "scatter (gather rows)", "experts", "combine"):
        assert phases[f"{phase} fwd"] > 0, phase
    for phase in ("router", "aux loss", "scatter (gather rows)", "experts", "combine"):
        assert phases[f"{phase} bwd"] > 0, phase
    assert "FFN (fc1, GELU, fc2) fwd" not in phases                     # the MoE model has no dense MLP
    model_b, _, step_b, _, _ = fresh()
    step_b()
    step_b()
    for (n, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(a, b), n
    # negative control: one step fewer is a different model, and the comparison sees it
    model_c, _, step_c, _, _ = fresh()
    step_c()
    assert not all(torch.equal(a, c) for a, c in zip(model_a.parameters(), model_c.parameters()))


def test_every_cut_tried_is_the_same_computation_and_a_wrong_one_is_refused():
    """``benchmarks/step_cuts.py`` times only cuts that compute what the plain form does (outputs and gradients
    within 1e-3), its gate step is NoisyGate's own forward, and a softmax over the wrong dimension is refused
    before any timing (negative control)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import step_cuts
    finally:
        sys.path.pop(0)
    table = step_cuts.cuts()
    assert len(table) == 5 and sum(adopted for *_, adopted in table.values()) == 1
    for name, (plain, cut, leaves, _) in table.items():
        assert step_cuts.same_computation(name, plain, cut, leaves) <= 1e-3
    gate = NoisyGate(step_cuts.D, step_cuts.E, top_k=step_cuts.K)
    x = torch.randn(256, step_cuts.D)
    torch.manual_seed(1)
    _, score = gate(x)                                                  # the core's forward, same noise seed
    assert torch.equal(step_cuts.gate_step(gate, x), score.square().sum() + gate.get_loss().sum())
    top = torch.randn(64, 2, requires_grad=True)
    with pytest.raises(ValueError, match="wrong dim: the cut differs from the plain form"):
        step_cuts.same_computation("wrong dim", lambda: torch.softmax(top, -1), lambda: torch.softmax(top, 0), [top])
