"""labutils/moe/traffic.py pinned for mutation testing (issue 38), in one process and without a process group.

Every expected count or byte total is worked out by hand in the test (in the comments), never by calling the
function under test; error messages are compared in full. The wire count (``wire_bytes_of_call``) and the control
collectives are checked against a patched ``torch.distributed`` and ``labutils.wire.count_wire`` that record what
they are asked to do, so the order, shapes and repeats are pinned without ranks (the real wire is tested in the
dist files). The plots are read back from the matplotlib figure: data, positions, colours, texts and sizes."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
import torch
import torch.distributed as dist
from matplotlib import cycler
from matplotlib.colors import to_rgba

from labutils import wire
from labutils.moe import traffic
from labutils.moe.traffic import (
    TrafficLog,
    capacity_use,
    check_wire,
    dedup_minimum_bytes,
    deepspeed_bytes,
    deepspeed_dropped,
    minimum_bytes,
    plot_capacity_use,
    plot_token_matrix,
    token_matrix,
    wire_bytes_of_call,
    wire_payload,
)


@pytest.fixture(autouse=True)
def _no_group_left():
    before = dist.is_initialized()   # a group an earlier test left is not this test's
    yield
    plt.close("all")
    assert before or dist.is_initialized() is False, "this test left a process group initialised"


def exact(t, values, dtype=torch.long):
    assert t.dtype == dtype and t.tolist() == values, (t, values)


# -- bookkeeping ---------------------------------------------------------------------------------------------

def test_sent_bytes_leaves_out_own_rows_unless_asked():
    log = TrafficLog()
    assert log.calls == [] and TrafficLog().calls is not log.calls
    log.calls += [{"send_rows": [1, 2, 3], "row_bytes": 4}, {"send_rows": [5, 0, 7], "row_bytes": 8}]
    assert log.sent_bytes(1) == 1 * 4 + 3 * 4 + 5 * 8 + 7 * 8 == 112
    assert log.sent_bytes(1, include_self=True) == 112 + 2 * 4 == 120
    assert log.sent_bytes(0) == 2 * 4 + 3 * 4 + 0 * 8 + 7 * 8 == 76
    assert log.sent_bytes(2, True) == 6 * 4 + 12 * 8


def test_record_keeps_plain_ints_under_the_layers_id():
    class Layer:
        layer_id = 7

    log = TrafficLog()
    log.record(Layer(), torch.tensor([1, 2]), [3, torch.tensor(4)], torch.tensor(16))
    log.record(Layer(), [0], [5], 2)
    assert log.calls == [{"layer": 7, "send_rows": [1, 2], "recv_rows": [3, 4], "row_bytes": 16},
                         {"layer": 7, "send_rows": [0], "recv_rows": [5], "row_bytes": 2}]
    first = log.calls[0]
    assert all(type(v) is int for v in first["send_rows"] + first["recv_rows"] + [first["row_bytes"], first["layer"]])


def test_record_traffic_hooks_every_moe_layer_and_unhooks_them():
    class Moe(torch.nn.Module):
        def run_experts(self, x, counts):
            return x

    model = torch.nn.Sequential(Moe(), torch.nn.Linear(2, 2), Moe())
    with traffic.record_traffic(model) as log:
        assert [m.exchange_hooks for m in (model[0], model[2])] == [[log.record], [log.record]]
    assert model[0].exchange_hooks == [] and model[2].exchange_hooks == []
    with pytest.raises(ValueError) as e, traffic.record_traffic(torch.nn.Linear(2, 2)):
        pass
    assert str(e.value) == "record_traffic: Linear contains no MoE layer (FMoE) to record"


# -- matrices and minimums -----------------------------------------------------------------------------------

def test_token_matrix_sums_each_destinations_experts():
    # rank 0 sends experts 0,1 (rank 0) 1+2, experts 2,3 (rank 1) 3+4; rank 1: 5+6, 7+8
    exact(token_matrix([[1, 2, 3, 4], [5, 6, 7, 8]], 2), [[3, 7], [11, 15]])
    exact(token_matrix(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), 1), [[1, 2], [3, 4]])
    with pytest.raises(ValueError) as e:
        token_matrix([[1, 2, 3], [4, 5, 6]], 2)
    assert str(e.value) == "expected (2, 4) counts, got (2, 3)"


MATRIX = [[1, 2, 0], [4, 5, 6], [0, 1, 9]]


def test_minimum_bytes_counts_only_off_rank_rows():
    # off-rank rows per source: 2+0, 4+6, 0+1 -> x d=3 x 4 bytes
    exact(minimum_bytes(torch.tensor(MATRIX), 3, 4), [24, 120, 12])


def test_dedup_minimum_bytes_counts_each_remote_rank_once_per_token():
    idx = [torch.tensor([[0, 1], [2, 3], [4, -1], [1, 5]]),  # rank 0: 0 + 1 (rank 1) + 1 (rank 2) + 1 (rank 2)
           [[0, -1], [3, 2]],                                # rank 1: 1 (expert 0 is rank 0's) + 0 (own)
           [5, 0, 2]]                                        # rank 2, k=1: own, rank 0, rank 1
    exact(dedup_minimum_bytes(idx, 2, 3, 2), [3 * 6, 1 * 6, 2 * 6])


def test_capacity_use_per_expert():
    use = capacity_use([[5, 0, 2], [1, 7, 3]], 3)   # kept [[3,0,2],[1,3,3]]
    assert list(use) == ["routed", "kept", "dropped", "padding"]
    exact(use["routed"], [6, 7, 5])
    exact(use["kept"], [4, 3, 5])
    exact(use["dropped"], [2, 4, 0])
    exact(use["padding"], [2, 3, 1])                  # (3 - kept) summed over ranks
    exact(capacity_use([[5.5, 0.0, 2.9], [1.2, 7.0, 3.0]], 3)["kept"], [4, 3, 5])   # counts truncated to ints


def test_deepspeed_bytes_defaults_to_the_moe_layers_min_capacity_and_top_1():
    # 10 tokens / 4 experts * 1.0 = 2.5 -> 3, floored at min_capacity 4: 4 experts * 4 * d 3 * 2 B * (5-1) // 5
    got = deepspeed_bytes(10, 4, 5, 3, 2, 1.0)
    assert type(got) is int and got == 384 // 5 == 76
    assert deepspeed_bytes(10, 4, 5, 3, 2, 1.0, top_k=2, min_capacity=0) == 4 * 5 * 3 * 2 * 4 // 5 == 96  # C=5
    assert deepspeed_bytes(10, 4, 5, 3, 2, 1.0, min_capacity=0) == 4 * 3 * 3 * 2 * 4 // 5 == 57          # C=3
    assert deepspeed_bytes(10, 4, 1, 3, 2, 1.0) == 0


def test_deepspeed_dropped_counts_rows_over_capacity():
    counts = [[5, 0, 2], [1, 7, 3]]
    # C = max(ceil(6 / 3 * 1.0), 4) = 4: (5-4) + (7-4)
    got = deepspeed_dropped(counts, 6, 1.0)
    assert type(got) is int and got == 4
    assert deepspeed_dropped(torch.tensor(counts), 6, 1.0, min_capacity=0) == 3 + 5 + 1   # C=2
    assert deepspeed_dropped(counts, 6, 1.0, top_k=2, min_capacity=0) == 4                 # C=4
    assert deepspeed_dropped(counts, 6, 1.0, top_k=2, min_capacity=5) == 0 + 2             # C=5
    assert deepspeed_dropped([[5.9, 0, 2], [1, 7.9, 3]], 6, 1.0) == 4                      # 5 and 7 rows


# -- the wire ------------------------------------------------------------------------------------------------

def test_wire_payload_is_rows_out_plus_rows_back():
    # off-diagonal row sums [2, 10, 1] + column sums [4, 3, 6], x 8 bytes
    exact(wire_payload(MATRIX, 8), [48, 104, 56])
    exact(wire_payload(torch.tensor(MATRIX), torch.tensor(2)), [12, 26, 14])
    got = wire_payload([[1.0, 2.5], [3.9, 4.0]], 10)   # counts are whole rows: floats truncate to int64
    assert got.dtype == torch.int64 and got.tolist() == [50, 50]


def test_check_wire_returns_the_bytes_beyond_the_fixed_cost():
    wire_counts = [{"control": 100, "fixed": 100, "call": 148}, {"control": 7, "fixed": 7, "call": 111},
                   {"control": 0, "fixed": 0, "call": 56}]
    exact(check_wire(wire_counts, torch.tensor(MATRIX), 8), [48, 104, 56])


def test_check_wire_names_every_rank_that_sent_other_bytes():
    wire_counts = [{"control": 1200, "fixed": 1500, "call": 1548}, {"control": 7, "fixed": 7, "call": 111},
                   {"control": 3000, "fixed": 3000, "call": 3050}]
    with pytest.raises(AssertionError) as e:
        check_wire(wire_counts, torch.tensor(MATRIX), 8)
    assert str(e.value) == (
        "the exchange put other bytes on the wire than the routed rows and its control messages:\n"
        "  rank 0: the call with no rows sent 1,500 B, the allowed control collectives 1,200 B (+300 B)\n"
        "  rank 2: 50 B beyond the fixed cost, the routed rows need 56 B (-6 B)")
    wire_counts[0]["control"], wire_counts[2]["call"] = 1500, 4300
    with pytest.raises(AssertionError) as e:
        check_wire(wire_counts, torch.tensor(MATRIX), 8)
    assert str(e.value) == (
        "the exchange put other bytes on the wire than the routed rows and its control messages:\n"
        "  rank 2: 1,300 B beyond the fixed cost, the routed rows need 56 B (+1,244 B)")
    with pytest.raises(ValueError) as e:
        check_wire(wire_counts[:2], torch.tensor(MATRIX), 8)
    assert str(e.value) == "check_wire: 2 ranks' counts for a (3,) routing"


def fake_dist(monkeypatch, world):
    """torch.distributed stand-ins that log each call; ``group`` answers ``world`` ranks, any other group 99."""
    group, events = object(), []

    def all_to_all_single(out, inp, out_splits=None, in_splits=None, group=None):
        events.append(("a2a", tuple(out.shape), out.dtype, tuple(inp.shape), inp.dtype, inp.tolist(),
                       out_splits, in_splits, group))

    monkeypatch.setattr(dist, "all_to_all_single", all_to_all_single)
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: world if g is group else 99)
    monkeypatch.setattr(dist, "barrier", lambda group=None: events.append(("barrier", group)))
    return group, events


@pytest.mark.parametrize("world, ne", [(2, 16), (3, 17)])
def test_control_collectives_are_the_checked_counts_and_two_empty_row_exchanges(monkeypatch, world, ne):
    group, events = fake_dist(monkeypatch, world)
    traffic._control_collectives(world, ne, 5, torch.float16, group)
    want = [("a2a", (world * 25,), torch.long, (world * 25,), torch.long, [0] * (world * 25), None, None, group)]
    if ne > 16:   # more experts per rank than COUNT_SLOTS: the bare counts too
        want.append(("a2a", (world * ne,), torch.long, (world * ne,), torch.long, [0] * (world * ne), None, None,
                     group))
    want += [("a2a", (0, 5), torch.float16, (0, 5), torch.float16, [], [0] * world, [0] * world, group)] * 2
    assert events == want


def test_wire_bytes_of_call_counts_each_run_between_barriers_and_keeps_the_smallest(monkeypatch):
    group, events = fake_dist(monkeypatch, 3)
    sent = iter([50, 70, 90, 40, 80, 95, 45, 60, 91, 41, 65, 99, 55, 61, 92])

    class Counter:
        def __enter__(self):
            events.append("count")
            return self

        def __exit__(self, *exc):
            self.sent = next(sent)
            events.append("counted")

    monkeypatch.setattr(wire, "count_wire", lambda: Counter())
    monkeypatch.setattr(traffic, "_control_collectives", lambda *a: events.append(("control", a)))

    class Layer:
        num_expert, moe_group = torch.tensor(4), group

        def __call__(self, x):
            events.append(("layer", tuple(x.shape), torch.is_grad_enabled()))

    x = torch.zeros(6, 5, dtype=torch.float64, requires_grad=True)
    assert wire_bytes_of_call(Layer(), x) == {"control": 40, "fixed": 60, "call": 90}
    one = [("barrier", group), "count", None, ("barrier", group), "counted"]
    runs = [("control", (3, 4, 5, torch.float64, group)), ("layer", (0, 5), False), ("layer", (6, 5), False)]
    assert events == [e if e is not None else run for _ in range(5) for run in runs for e in one]
    assert type(events[2][1][1]) is int
    events.clear()
    sent = iter([3, 2, 1])
    assert wire_bytes_of_call(Layer(), x, repeats=1) == {"control": 3, "fixed": 2, "call": 1}
    assert len(events) == 15
    for bad in (0, -1):
        with pytest.raises(ValueError) as e:
            wire_bytes_of_call(Layer(), x, repeats=bad)
        assert str(e.value) == f"wire_bytes_of_call: repeats must be >= 1, got {bad!r}"


def test_wire_bytes_of_call_uses_the_default_group_without_moe_group_and_the_rows_last_dim(monkeypatch):
    group, events = fake_dist(monkeypatch, 2)
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: 2 if g is None else 99)

    class Counter:
        sent = 1

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(wire, "count_wire", lambda: Counter())
    monkeypatch.setattr(traffic, "_control_collectives", lambda *a: events.append(("control", a)))

    class Bare:   # no moe_group attribute: the default group
        num_expert = 3

        def __call__(self, x):
            pass

    x = torch.zeros(2, 4, 7)   # (B, T, d): the row width is the last dim
    assert wire_bytes_of_call(Bare(), x, repeats=1) == {"control": 1, "fixed": 1, "call": 1}
    assert ("control", (2, 3, 7, torch.float32, None)) in events
    assert ("barrier", None) in events


# -- plots ---------------------------------------------------------------------------------------------------

OTHER_STYLE = {"figure.dpi": 72, "axes.prop_cycle": cycler(color=["m", "y", "k"])}


def line_props(line):
    return (list(line.get_xdata()), list(line.get_ydata()), line.get_color(), line.get_linewidth(),
            line.get_linestyle())


def test_plot_capacity_use_draws_kept_padding_dropped_per_expert():
    counts = [[5, 0, 2, 1], [1, 7, 3, 0]]   # 2 ranks, 2 experts each
    with plt.rc_context(OTHER_STYLE):                                   # its own colours and dpi, whatever the style
        fig = plot_capacity_use(counts, {"a": 3, "b": 5}, 2)
    assert list(fig.get_size_inches()) == pytest.approx([6.6, 2.9]) and fig.dpi == 100
    assert len(fig.axes) == 2
    a0, a1 = fig.axes
    assert a0.get_shared_y_axes().joined(a0, a1)
    # C=3: kept [4,3,5,1], padding [2,3,1,5], dropped [2,4,0,0]; C=5: kept [6,5,5,1], padding [4,5,5,9], dropped
    # [0,2,0,0]; top = 1.15 * max(7 rows at most, 2 ranks * 5)
    want = {3: ([4, 3, 5, 1], [2, 3, 1, 5], [2, 4, 0, 0], "a: C=3, 6 dropped,\n11 padded slots"),
            5: ([6, 5, 5, 1], [4, 5, 5, 9], [0, 2, 0, 0], "b: C=5, 2 dropped,\n23 padded slots")}
    for ax, cap in ((a0, 3), (a1, 5)):
        kept, pad, drop, title = want[cap]
        bottoms = ([0] * 4, kept, [k + p for k, p in zip(kept, pad)])
        colors = ("tab:blue", "lightgrey", "tab:red")
        labels = ("kept", "padding (sent, empty)", "dropped")
        assert len(ax.containers) == 3
        for bars, height, bottom, color, label in zip(ax.containers, (kept, pad, drop), bottoms, colors, labels):
            assert bars.get_label() == label
            assert [p.get_x() + p.get_width() / 2 for p in bars] == pytest.approx([0, 1, 2, 3])
            assert [p.get_height() for p in bars] == height and [p.get_y() for p in bars] == bottom
            assert all(p.get_facecolor() == to_rgba(color) for p in bars)
        assert [line_props(li) for li in ax.get_lines()] == [([0, 1], [2 * cap, 2 * cap], "black", 1, "--"),
                                                             ([1.5, 1.5], [0, 1], "tab:orange", 0.5, "-")]
        assert ax.get_title() == title and ax.title.get_fontsize() == 8
        assert ax.get_xlabel() == "global expert (orange: rank boundary)" and ax.xaxis.label.get_fontsize() == 8
        assert ax.get_ylim() == pytest.approx((0, 11.5))
    assert a0.get_ylabel() == "rows (dashed: W*C = 2*C slots)" and a0.yaxis.label.get_fontsize() == 8
    assert a1.get_ylabel() == "" and a1.get_legend() is None
    legend = a0.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["kept", "padding (sent, empty)", "dropped"]
    assert legend.get_texts()[0].get_fontsize() == 6 and legend._loc == 2   # "upper left"


def test_plot_capacity_use_one_panel_and_three_ranks():
    # 3 ranks, 1 expert each, as [[1, 0, 9], [0, 2, 0], [3, 0, 0]] once truncated to ints
    counts = torch.tensor([[1.5, 0.2, 9.9], [0.0, 2.7, 0.0], [3.1, 0.0, 0.4]])
    fig = plot_capacity_use(counts, {"x": 2}, 1)
    assert list(fig.get_size_inches()) == pytest.approx([3.3, 2.9]) and len(fig.axes) == 1
    ax = fig.axes[0]
    assert [line_props(li)[:2] for li in ax.get_lines()] == [([0, 1], [6, 6]), ([0.5, 0.5], [0, 1]),
                                                            ([1.5, 1.5], [0, 1])]
    assert ax.get_ylim() == pytest.approx((0, 1.15 * 9))   # the 9 rows of expert 2 top the 3 * 2 slots
    assert ax.get_title() == "x: C=2, 8 dropped,\n11 padded slots"   # 7 + 1 over; 1+2, 2+2, 2+2 empty
    assert ax.get_ylabel() == "rows (dashed: W*C = 3*C slots)"


def test_plot_token_matrix_writes_each_count_and_frames_the_diagonal():
    m = [[1, 2, 0], [4, 10, 6], [0, 3, 9]]
    with plt.rc_context(OTHER_STYLE):
        fig = plot_token_matrix(torch.tensor(m))
    assert list(fig.get_size_inches()) == pytest.approx([2.5, 2.15]) and fig.dpi == 100
    ax, bar = fig.axes
    (im,) = ax.images
    assert im.get_array().tolist() == m and im.get_cmap().name == "Blues"
    assert bar.get_ylim() == pytest.approx((0, 10))
    texts = [(t.get_position(), t.get_text(), t.get_ha(), t.get_va(), t.get_fontsize(), t.get_color())
             for t in ax.texts]
    # white on dark cells only: over 0.6 * 10 (6 itself stays black)
    assert texts == [((c, r), str(m[r][c]), "center", "center", 8, "white" if m[r][c] > 6 else "black")
                     for r in range(3) for c in range(3)]
    assert [(p.get_xy(), p.get_width(), p.get_height(), p.get_fill(), p.get_edgecolor(), p.get_linewidth())
            for p in ax.patches] == [((r - 0.5, r - 0.5), 1, 1, False, to_rgba("tab:orange"), 1.5) for r in range(3)]
    assert ax.get_xlabel() == "destination rank (holds the expert)"
    assert ax.get_ylabel() == "source rank (holds the token)"
    assert list(ax.get_xticks()) == [0, 1, 2] and list(ax.get_yticks()) == [0, 1, 2]
    assert ax.get_title() == "rows sent, rank -> rank" and ax.title.get_fontsize() == 10
    assert plot_token_matrix([[0, 5], [1, 2]], title="T").axes[0].get_title() == "T"


def test_plot_token_matrix_keeps_its_title_size_and_a_thin_colorbar_under_any_style(monkeypatch):
    """x_plot_token_matrix__mutmut_98 (title size from the style), 107/108 (the colorbar's share of the width):
    the title stays 10 pt whatever the style's sizes, and the colorbar takes 4.6% of the heatmap's width (the
    fraction that keeps a small heatmap readable; matplotlib's default is 15%)."""
    import matplotlib.figure

    real = matplotlib.figure.Figure.colorbar
    asked = []

    def colorbar(self, mappable, **kw):
        asked.append(kw.get("fraction", "default"))
        return real(self, mappable, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "colorbar", colorbar)
    with plt.rc_context({"font.size": 7, "axes.titlesize": 20}):
        fig = plot_token_matrix(torch.tensor([[1, 2], [3, 4]]))
    ax, bar = fig.axes
    assert ax.title.get_fontsize() == 10 and ax.texts[0].get_fontsize() == 8
    assert asked == [0.046]
    # the colorbar sits right of the heatmap, as tall as it, and narrower than a tenth of it
    h, b = ax.get_position(), bar.get_position()
    assert b.x0 > h.x1 and b.height == pytest.approx(h.height) and b.width < 0.1 * h.width
