"""Chapter 08's paragraph on the GPU record: ``benchmarks/gpu_layer.py``'s layer table (issue 40). (Chapter 08.)

Kept apart from :mod:`labbook.reports.ch08` because it reads a record that only a GPU machine writes; given none
it says so plainly.
"""
from __future__ import annotations

__all__ = ["gpu_record", "NO_GPU_RECORD"]

NO_GPU_RECORD = ("No GPU record yet: run `python benchmarks/gpu_layer.py` on a machine with a CUDA GPU; the book has "
                 "not measured the GPU rows.")


def gpu_record(record: dict | None) -> str:
    """``benchmarks/gpu_layer.py``'s record (``labbook.records.load_optional("gpu_layer.json")``), or None when no
    GPU machine has written it: the device and versions, then per shape and dtype the grouped-GEMM limit's and the
    lab layer's median step, their ratio and issue 40's verdict (the lab layer at >= 0.8 of the limit's speed),
    then the lab layer against real fastmoe. Given None it says plainly that nothing was measured."""
    if record is None:
        return NO_GPU_RECORD
    if not isinstance(record, dict):
        raise TypeError(f"gpu_record takes gpu_layer.json's record (a dict) or None, got {type(record).__name__}")
    for key in ("versions", "results", "timing", "target"):
        if key not in record:
            raise KeyError(f"gpu_record needs record[{key!r}] (written by benchmarks/gpu_layer.py)")
    v, t, target = record["versions"], record["timing"], record["target"]["speed"]
    fm = v.get("fastmoe") or {}
    fastmoe = (f"fastmoe {fm.get('commit') or 'version unknown'}" if fm.get("available") else "fastmoe not installed")
    where = record.get("gpu") or record.get("device", "an unnamed device")
    head = (f"**The layer on a GPU** (`benchmarks/gpu_layer.py --preset {record.get('preset', '?')}`, "
            f"{record.get('machine', {}).get('date', 'undated')}): {where}, torch {v['torch']}, CUDA "
            f"{v.get('cuda') or 'none'}, {fastmoe}. Forward + backward, median of {t['rounds']} interleaved rounds "
            f"({t['clock']}). Target: the lab layer at >= {target:.2f} of the grouped-GEMM limit's speed "
            "(grouped ms / lab ms).")
    if record.get("smoke"):
        head += " **This record is a CPU smoke run of the machinery, not a GPU measurement.**"
    lines = [head, "", "| shape | dtype | grouped ms | lab ms | grouped / lab | verdict |", "|---|---|---|---|---|---|"]
    for e in record["results"]:
        s = e["shape"]
        shape = f"T{s['T']} d{s['d']} h{s['h']} E{s['E']} k{s['k']}"
        if e.get("verdict"):
            lines.append(f"| {shape} | {e['dtype']} | {e['grouped_ms']:.2f} | {e['lab_ms']:.2f} | "
                         f"{e['verdict']['speed']:.2f} | {e['verdict']['verdict']} |")
        else:
            lines.append(f"| {shape} | {e['dtype']} | - | - | - | not measured ({e.get('why_no_verdict', '?')}) |")
    calls = [e["verdict"]["verdict"] for e in record["results"] if e.get("verdict")]
    lines += ["", f"Met at {calls.count('met')} of {len(record['results'])} shape/dtype pairs, NOT met at "
              f"{calls.count('NOT met')}."]
    diffs = [(e["dtype"], e["parity"]["max_abs_diff"]) for e in record["results"]
             if (e.get("parity") or {}).get("max_abs_diff") is not None]
    if diffs:
        worst = {d: max(x for dt, x in diffs if dt == d) for d in dict(diffs)}
        lines[-1] += (" The lab layer against real fastmoe on copied weights, largest output difference: "
                      + ", ".join(f"{x:.1e} ({d})" for d, x in worst.items()) + ".")
    else:
        why = next(((e.get("parity") or {}).get("why") for e in record["results"]), None)
        lines[-1] += f" Real fastmoe was not compared ({why or 'no parity in the record'})."
    return "\n".join(lines)
