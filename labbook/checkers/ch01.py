"""Chapter 01's exercise cases for the grader (:mod:`labbook.grader`): a top-k MoE forward from plain tensors, the
Switch balancing loss, ``count_by_gate``, a top-k gate on logits, and capacity dropping. Serves
notebooks/01_fastmoe_core.ipynb; red-teamed by tests/test_grader_ch01.py. Also the harness of section 8's training
check cells (the reader's two functions as a layer in a char LM, trained with and without the balancing loss).

Every reference here is a brute-force loop over tokens written for the grader, not the lab's ``labutils.moe`` code
the exercise re-implements; it runs in the grading parent only.
"""
from __future__ import annotations

import math

import torch

from labbook.grader.answers import Cases

# --- brute-force references ---------------------------------------------------------------------------------


def _gelu(v: float) -> float:
    return 0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0)))


def _best_first(row: list, k: int) -> list:
    """Indices of the k largest values of ``row``, largest first (a stable sort: the lower index wins a tie)."""
    return sorted(range(len(row)), key=lambda e: -row[e])[:k]


def _softmax(vals: list) -> list:
    top = max(vals)
    ex = [math.exp(v - top) for v in vals]
    return [v / sum(ex) for v in ex]


def moe_forward_reference(x, w_gate, b_gate, W1, b1, W2, b2, k):
    """Token by token, in float64 Python numbers: the top-k of the gate's logits (chosen on the float32 logits),
    the softmax over those k, then ``sum_j g_j * (W2[e] gelu(W1[e] x + b1[e]) + b2[e])``. ``(T, d)``."""
    logits32 = (x @ w_gate.T + b_gate).tolist()                              # (T, E) selection as in float32
    X, Wg, bg = x.double().tolist(), w_gate.double(), b_gate.double()
    out = []
    for t, row in enumerate(X):
        xt = torch.tensor(row, dtype=torch.float64)                          # (d,)
        chosen = _best_first(logits32[t], k)
        lg = [float(Wg[e] @ xt + bg[e]) for e in chosen]
        y = torch.zeros(len(row), dtype=torch.float64)
        for g, e in zip(_softmax(lg), chosen):
            hid = torch.tensor([_gelu(float(v)) for v in (W1[e].double() @ xt + b1[e].double())], dtype=torch.float64)
            y += g * (W2[e].double() @ hid + b2[e].double())
        out.append(y)
    return torch.stack(out) if out else torch.zeros(0, x.shape[1], dtype=torch.float64)


def switch_loss_reference(logits):
    """``E * sum_e f_e * P_e`` by counting: ``f_e`` share of tokens whose largest logit is ``e``, ``P_e`` mean
    softmax probability of ``e`` (float64). Zero tokens: 0."""
    rows = logits.double().tolist()
    T, E = len(rows), logits.shape[1]
    if T == 0:
        return torch.tensor(0.0, dtype=torch.float64)
    f, P = [0.0] * E, [0.0] * E
    for row in rows:
        f[_best_first(row, 1)[0]] += 1.0 / T
        for e, p in enumerate(_softmax(row)):
            P[e] += p / T
    return torch.tensor(E * sum(a * b for a, b in zip(f, P)), dtype=torch.float64)


def count_by_gate_reference(gate_idx, num_expert):
    """``pos``: flattened choice positions expert by expert, in token order within an expert; ``counts`` (E,)."""
    flat = gate_idx.reshape(-1).tolist()
    pos = [i for e in range(num_expert) for i, v in enumerate(flat) if v == e]
    return torch.tensor(pos, dtype=torch.int64), torch.tensor([flat.count(e) for e in range(num_expert)])


def topk_gate_reference(logits, k):
    """``(idx (T, k) best first, score (T, k) softmax over the k chosen logits)``, row by row."""
    idx, score = [], []
    for row in logits.tolist():                                              # float32 values, exact in float
        chosen = _best_first(row, k)
        idx.append(chosen)
        score.append(_softmax([row[e] for e in chosen]))
    return (torch.tensor(idx, dtype=torch.int64).reshape(-1, k),
            torch.tensor(score, dtype=torch.float64).reshape(-1, k))


def drop_reference(gate_idx, num_expert, capacity):
    """Keep a choice while its expert has room, all first choices in token order, then all second choices..."""
    out = gate_idx.tolist()
    load = [0] * num_expert
    for j in range(gate_idx.shape[1]):
        for t in range(gate_idx.shape[0]):
            e = out[t][j]
            if e < 0:
                continue
            if load[e] < capacity:
                load[e] += 1
            else:
                out[t][j] = -1
    return torch.tensor(out, dtype=torch.int64).reshape(gate_idx.shape)


# --- cases ------------------------------------------------------------------------------------------------


def moe_case(gen, T, d, h, E, k):
    """Random plain-tensor weights in fastmoe's init scale: ``(x, w_gate, b_gate, W1, b1, W2, b2, k)``."""
    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale
    return (r(T, d), r(E, d, scale=d ** -0.5), r(E, scale=0.1), r(E, h, d, scale=d ** -0.5), r(E, h, scale=0.1),
            r(E, d, h, scale=h ** -0.5), r(E, d, scale=0.1), k)


def moe_visible():
    gen = torch.Generator().manual_seed(7)
    return [moe_case(gen, *shape) for shape in [(12, 8, 16, 4, 2), (7, 6, 10, 5, 1), (20, 8, 12, 6, 3)]]


def _moe_hidden(gen, i):
    E = int(torch.randint(2, 9, (1,), generator=gen))
    k = int(torch.randint(1, min(E, 3) + 1, (1,), generator=gen))
    T, d, h = (int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in [(1, 25), (2, 11), (2, 13)])
    return moe_case(gen, T, d, h, E, k)



def switch_visible():
    gen = torch.Generator().manual_seed(8)
    return [(torch.randn(16, 4, generator=gen),), (torch.randn(9, 8, generator=gen) * 3,),
            (torch.randn(1, 3, generator=gen),)]


def _switch_hidden(gen, i):
    T, E = int(torch.randint(1, 40, (1,), generator=gen)), int(torch.randint(2, 17, (1,), generator=gen))
    return (torch.randn(T, E, generator=gen) * float(torch.rand(1, generator=gen) * 4 + 0.1),)



def count_visible():
    gen = torch.Generator().manual_seed(4)
    return [(torch.randint(0, 4, (10, 2), generator=gen), 4), (torch.randint(-1, 6, (33, 2), generator=gen), 6),
            (torch.randint(-1, 3, (7, 1), generator=gen), 3), (torch.zeros(0, 2, dtype=torch.long), 5)]


def _count_hidden(gen, i):
    E = int(torch.randint(1, 9, (1,), generator=gen))
    T, k = int(torch.randint(0, 40, (1,), generator=gen)), int(torch.randint(1, 4, (1,), generator=gen))
    return torch.randint(-1, E, (T, k), generator=gen), E



def topk_visible():
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(12, 8, generator=gen), 2), (torch.randn(5, 4, generator=gen), 1),
            (torch.randn(9, 6, generator=gen), 3)]


def _topk_hidden(gen, i):
    E = int(torch.randint(2, 17, (1,), generator=gen))
    T, k = int(torch.randint(1, 30, (1,), generator=gen)), int(torch.randint(1, min(E, 4) + 1, (1,), generator=gen))
    return torch.randn(T, E, generator=gen) * 2, k



def drop_visible():
    gen = torch.Generator().manual_seed(6)
    return [(torch.tensor([[0, 1], [0, 1], [0, 2], [1, 0], [0, 1]]), 3, 2),   # token order != priority order
            (torch.randint(0, 4, (16, 2), generator=gen), 4, 5), (torch.randint(-1, 3, (20, 2), generator=gen), 3, 4),
            (torch.randint(0, 5, (9, 1), generator=gen), 5, 1)]


def _drop_hidden(gen, i):
    E = int(torch.randint(1, 7, (1,), generator=gen))
    T, k = int(torch.randint(1, 30, (1,), generator=gen)), int(torch.randint(1, min(E, 3) + 1, (1,), generator=gen))
    return torch.randint(-1, E, (T, k), generator=gen), E, int(torch.randint(0, 8, (1,), generator=gen))


CASES = {
    "my_moe_forward": lambda: Cases(moe_forward_reference, moe_visible(), _moe_hidden, rtol=1e-4, atol=1e-5),
    "my_switch_loss": lambda: Cases(switch_loss_reference, switch_visible(), _switch_hidden),
    "my_count_by_gate": lambda: Cases(count_by_gate_reference, count_visible(), _count_hidden),
    "my_topk_gate": lambda: Cases(topk_gate_reference, topk_visible(), _topk_hidden),
    "my_drop_over_capacity": lambda: Cases(drop_reference, drop_visible(), _drop_hidden),
}


# --- the chapter's control on the grader: a wrong gate it must fail -----------------------------------------------

SWITCH_SCORES = """
def my_moe_forward(x, w_gate, b_gate, W1, b1, W2, b2, k):
    probs = torch.softmax(x @ w_gate.T + b_gate, dim=-1)                   # (T, E): Switch's scores
    top_p, top_idx = torch.topk(probs, k, dim=-1)
    y = torch.zeros_like(x)
    for e in range(w_gate.shape[0]):
        tok, slot = torch.nonzero(top_idx == e, as_tuple=True)
        hid = torch.nn.functional.gelu(x[tok] @ W1[e].T + b1[e])
        y = y.index_add(0, tok, top_p[tok, slot, None] * (hid @ W2[e].T + b2[e]))
    return y
"""  # the layer with Switch's scores (softmax over all E, then the top k): for k > 1 its weights do not sum to 1

# --- section 8's training check: the reader's two functions as a layer in a char LM (checker cells) -------------

ARMS = {"balancing loss": dict(aux=0.01, out=1.0), "no balancing loss": dict(aux=0.0, out=1.0),
        "zero-output control": dict(aux=0.01, out=0)}                  # out 0: the layer's output multiplied by 0


class MyMoE(torch.nn.Module):
    """The reader's ``my_moe_forward`` and ``my_switch_loss`` as a layer; the Switch loss kept like a gate's
    (``get_loss``/``has_loss``, so ``labutils.train`` adds ``aux_coef x`` it), the top-1 share per expert recorded
    at every training step. ``out_scale`` 0: the zero-output control."""

    def __init__(self, moe_forward, switch_loss, d, h, E, k, out_scale=1):
        super().__init__()
        self.moe_forward, self.switch_loss = moe_forward, switch_loss
        self.k, self.out_scale, s1, s2 = k, out_scale, d ** -0.5, h ** -0.5
        self.w_gate, self.b_gate = torch.nn.Parameter(torch.randn(E, d) * s1), torch.nn.Parameter(torch.zeros(E))
        self.W1, self.b1 = torch.nn.Parameter(torch.randn(E, h, d) * s1), torch.nn.Parameter(torch.zeros(E, h))
        self.W2, self.b2 = torch.nn.Parameter(torch.randn(E, d, h) * s2), torch.nn.Parameter(torch.zeros(E, d))
        self.has_loss, self.loss, self.loads = True, torch.zeros(()), []

    def forward(self, x):                                                   # (B, T, d)
        xt = x.reshape(-1, x.shape[-1])                                     # (B*T, d)
        logits = xt @ self.w_gate.T + self.b_gate                           # (B*T, E)
        self.loss = self.switch_loss(logits)
        if self.training:                                                   # top-1 share per expert, per step
            self.loads.append(torch.bincount(logits.argmax(-1), minlength=len(self.b_gate)).float() / len(xt))
        if self.out_scale == 0:                                             # the control: the layer's output is 0
            return torch.zeros_like(x)
        y = self.moe_forward(xt, self.w_gate, self.b_gate, self.W1, self.b1, self.W2, self.b2, self.k)
        return y.reshape(x.shape)

    def get_loss(self, clear=True):
        return self.loss


def train_arm(moe_forward, switch_loss, build: dict, corpus, seed: int, aux: float, out) -> tuple:
    """One char LM (chapter 05's, on ``corpus``, the standard library's source) with the reader's layer, the router's
    learning rate ``build["router_lr"]`` x the rest's: (mean loss of the last 20 steps, (steps, E) top-1 shares)."""
    from labutils.data import CharBatches
    from labutils.models import CharLM
    from labutils.train import lm_cross_entropy, train

    b = build
    torch.manual_seed(seed)                                                 # the same initialisation in every arm
    lm = CharLM(corpus.vocab_size, b["d"], 2, 1, b["block"],
                lambda: MyMoE(moe_forward, switch_loss, b["d"], b["h"], b["experts"], b["k"], out))
    router = [p for n, p in lm.named_parameters() if n.endswith(("w_gate", "b_gate"))]
    rest = [p for n, p in lm.named_parameters() if not n.endswith(("w_gate", "b_gate"))]
    opt = torch.optim.Adam([dict(params=rest), dict(params=router, lr=3e-3 * b["router_lr"])], lr=3e-3)
    res = train(lm, CharBatches(corpus.train, b["batch"], b["block"], seed=seed), steps=b["steps"], optimizer=opt,
                loss_fn=lm_cross_entropy, aux_coef=aux, record_load=False, progress=False)
    return sum(res.losses[-20:]) / 20, torch.stack(lm.blocks[0].ffn.loads)  # pyright: ignore[reportArgumentType, reportAttributeAccessIssue]


def train_arms(moe_forward, switch_loss, build: dict) -> dict:
    """Every arm of ``ARMS`` for every seed of ``build["seeds"]``, on one thread ((B*T, 32) matrices: a second
    thread only adds synchronisation): ``{arm: [(loss, (steps, E) top-1 shares) per seed]}``."""
    from labutils.data import stdlib_corpus

    corpus, threads = stdlib_corpus(), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {arm: [train_arm(moe_forward, switch_loss, build, corpus, s, **kw) for s in build["seeds"]]
                for arm, kw in ARMS.items()}
    finally:
        torch.set_num_threads(threads)


def busiest(shares) -> float:
    """(steps, E) top-1 shares -> the busiest expert's share over the last 20 steps."""
    return float(shares[-20:].mean(0).max())


def dead(shares) -> int:
    """(steps, E) top-1 shares -> experts under 1% of the top-1 choices over the last 20 steps."""
    return int((shares[-20:].mean(0) < 0.01).sum())
