"""Chapter 05's study, its set-up: the preset (:class:`StudyConfig`, ``PRESETS``), the three models and the
ablations (:func:`variants`), their FLOPs counted (:func:`train_flops_per_token`) and measured
(:func:`measured_train_flops`), the data-limited control (:func:`data_limited`). (Taught in chapter 05.)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from labbook.study import StudyPreset, build_lm, check_seeds
from labutils.models import CharLM, make_ffn
from labutils.train import lm_cross_entropy

MAIN = ("dense", "MoE", "dense-wide")
ABLATIONS = ("top-1", "top-1 Switch", "E=4", "E=16", "no balance loss", "E=k=2")
LOAD_WINDOWS = 40  # training loss and expert load are kept as means/sums over this many windows of steps


@dataclass(frozen=True)
class StudyConfig(StudyPreset):
    """One study: model shape, training length, seeds, and which ablations run (on every seed). A recorded run
    stores it whole (``asdict``) as its ``config``."""
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    block: int = 64
    batch: int = 32
    steps: int = 2000
    lr: float = 3e-3
    eval_every: int = 125
    num_expert: int = 8
    top_k: int = 2
    aux_coef: float = 0.01
    seeds: tuple = (0, 1, 2)
    ablations: tuple = ABLATIONS
    val_one_in: int = 25        # one stdlib file in this many is held out
    val_tokens: int = 0         # 0: the whole held-out set; n: its first n characters (tiny preset only)
    threads: int = 1            # torch threads per run
    train_chars: int = 0        # 0: the whole training split; n: its first n characters (the data-limited control)
    control_chars: int = 1_000_000  # training characters of the data-limited control (:func:`data_limited`)
    fused_adam: bool = True     # Adam's update as one kernel over all parameter tensors (:func:`optimizer`)
    name: str = "custom"

    def __post_init__(self):
        object.__setattr__(self, "seeds", check_seeds("StudyConfig(seeds=...)", self.seeds))  # a list -> a tuple
        # num_expert=0 would build the "MoE" row as a dense feed-forward and record it under the name MoE
        for what, value, low in (("num_expert", self.num_expert, 2), ("top_k", self.top_k, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"StudyConfig({what}=...): must be an int >= {low}, got {value!r} (an MoE routes "
                                 "each token to top_k of num_expert >= 2 experts; the dense baselines are built "
                                 "from d_model)")
        if not isinstance(self.fused_adam, bool):
            raise TypeError(f"StudyConfig(fused_adam=...): must be True or False, got {self.fused_adam!r}")
        if self.top_k > self.num_expert:
            raise ValueError(f"StudyConfig(top_k=...): must be between 1 and num_expert={self.num_expert}, got "
                             f"{self.top_k!r}")


PRESETS = {
    "tiny": StudyConfig(d_model=32, block=32, batch=16, steps=150, eval_every=30, seeds=(0, 1),
                        ablations=("top-1 Switch", "E=k=2"), lr=5e-3, val_tokens=32_768, control_chars=16_384,
                        name="tiny"),
    "full": StudyConfig(name="full"),
}


@dataclass(frozen=True)
class Variant:
    """A feed-forward: ``hidden`` is per expert for MoE (``experts`` > 0). ``gate``: ``"noisy"`` (fastmoe's
    ``NoisyGate``: the chosen experts weighted by a softmax over the top-k logits only, so at k = 1 the task gives
    the router no gradient) or ``"switch"`` (``SwitchGate``: top-1 weighted by the full softmax probability, the
    router trained through it; capacity factor 1.2 in training, 2.4 in evaluation, tokens over it dropped)."""
    hidden: int
    experts: int = 0
    top_k: int = 0
    aux_coef: float = 0.0
    gate: str = "noisy"

    def ffn(self, d: int):
        if not self.experts:
            return make_ffn("dense", d, self.hidden)
        from labutils.moe import NoisyGate, SwitchGate
        gates = {"noisy": NoisyGate, "switch": SwitchGate}
        if self.gate not in gates:
            raise ValueError(f"Variant.gate must be one of {sorted(gates)}, got {self.gate!r}")
        return make_ffn("fmoe", d, self.hidden, num_expert=self.experts, top_k=self.top_k, gate=gates[self.gate])

    @property
    def router_matmuls(self) -> int:
        """``(d, E)`` matmuls per token in the router: NoisyGate has clean and noise logits, SwitchGate one."""
        return 0 if not self.experts else 2 if self.gate == "noisy" else 1


def variants(cfg: StudyConfig) -> dict:
    """The three main models and the ablations, every MoE at the dense model's active feed-forward width."""
    d, E, k = cfg.d_model, cfg.num_expert, cfg.top_k
    table = {
        "dense": Variant(4 * d),
        "MoE": Variant(4 * d // k, E, k, cfg.aux_coef),
        "dense-wide": Variant(4 * d * E // k),
        "top-1": Variant(4 * d, E, 1, cfg.aux_coef),              # same active width, twice the experts' params
        "top-1 Switch": Variant(4 * d, E, 1, cfg.aux_coef, gate="switch"),  # the router trained by the task
        "E=4": Variant(4 * d // k, 4, k, cfg.aux_coef),
        "E=16": Variant(4 * d // k, 16, k, cfg.aux_coef),
        "no balance loss": Variant(4 * d // k, E, k, 0.0),
        "E=k=2": Variant(4 * d // 2, 2, 2, cfg.aux_coef),          # gated dense: MoE's FLOPs, dense's params
    }
    unknown = set(cfg.ablations) - set(table)
    if unknown:
        raise ValueError(f"unknown ablation(s) {sorted(unknown)}; choose from {sorted(set(table) - set(MAIN))}")
    return {name: table[name] for name in MAIN + tuple(cfg.ablations)}


def build(cfg: StudyConfig, variant: Variant, vocab_size: int, seed: int) -> CharLM:
    """One model of the study, initialised from ``seed`` (:func:`labbook.study.build_lm`, as chapter 09's)."""
    return build_lm(cfg, lambda: variant.ffn(cfg.d_model), vocab_size, seed)


def optimizer(cfg: StudyConfig, model: torch.nn.Module) -> torch.optim.Adam:
    """The study's optimizer: Adam at ``cfg.lr``. ``cfg.fused_adam``: torch's fused kernel, one pass over every
    parameter tensor instead of a Python loop of ~10 small ops per tensor (the MoE has 4 tensors per expert: 90
    in all); the same update up to float rounding (``tests/test_lm_study.py`` checks it). ``benchmarks/train_step.py``
    times both on the ``full`` models (chapter 08 §10 prints them)."""
    return torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=cfg.fused_adam or None)


def train_flops_per_token(cfg: StudyConfig, variant: Variant, vocab_size: int) -> int:
    """Matmul FLOPs per training token (forward + backward = 3x forward, multiply-add = 2 FLOPs). The router
    of ``NoisyGate`` is two ``(d, E)`` matmuls (clean and noise logits), ``SwitchGate``'s one. Attention scores
    count the whole ``T x T`` square (the causal mask does not skip work). :func:`measured_train_flops` checks it."""
    d, T = cfg.d_model, cfg.block
    active_ffn = 2 * d * variant.hidden * max(1, variant.top_k) + variant.router_matmuls * d * variant.experts
    attention = 4 * d * d + 2 * T * d                                                  # projections + scores
    forward = 2 * (cfg.n_layers * (active_ffn + attention) + d * vocab_size)
    return 3 * forward


def measured_train_flops(cfg: StudyConfig, variant: Variant, vocab_size: int, seed: int = 0) -> int:
    """FLOPs of one training step (forward + backward of a ``(batch, block)`` batch) counted by
    ``torch.utils.flop_counter.FlopCounterMode`` on the real model. Attention runs on SDPA's math backend here:
    the counter has no formula for the fused CPU kernel, and the math path does the same ``T x T`` products."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = build(cfg, variant, vocab_size, seed)
    x = torch.randint(vocab_size, (cfg.batch, cfg.block), generator=torch.Generator().manual_seed(seed))  # (B, T)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        lm_cross_entropy(model(x), x).backward()
    return int(counter.get_total_flops())


def data_limited(cfg: StudyConfig) -> StudyConfig:
    """The regime control: the main models on the first ``cfg.control_chars`` training characters, the same
    steps (so several epochs), no ablations."""
    return dataclasses.replace(cfg, train_chars=cfg.control_chars, ablations=(), name=f"{cfg.name} data-limited")


def epochs(cfg: StudyConfig, train_chars: int) -> float:
    """Characters drawn over the run (``steps x batch x block``) divided by the training characters."""
    return cfg.steps * cfg.batch * cfg.block / train_chars
