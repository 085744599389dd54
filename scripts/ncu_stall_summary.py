"""Where the Gluon kernel's consumer warps wait, from an Nsight Compute report's source page.

Reads what ``bash scripts/gpu_check.sh ncu`` exports for one precision: the SASS source page
(``ncu -i REPORT --page source --csv --print-source sass``: per instruction, the warp-state samples
by stall reason) and the details page (``--page details --csv``: issue rate, eligible warps and the
rules' findings). It finds the consumer's loops over a tile's blocks (a backward branch whose body
holds a ``GMMA``), and sums their samples by stall reason and by opcode. Both consumer warpgroups
have their own copy of the loop; each is summarized.

    python3 scripts/ncu_stall_summary.py native=ncu_native fp8=ncu_fp8 --json stalls.json

where ``ncu_native`` names ``ncu_native_sass.csv[.gz]`` and ``ncu_native_details.csv``.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SAMPLES = "Warp Stall Sampling (All Samples)"
LOOP_LIMIT = 1500  # instructions: longer backward branches are the tile loop or the persistent loop


def _rows(path: Path) -> list[list[str]]:
    if not path.exists() and path.with_suffix(path.suffix + ".gz").exists():
        path = path.with_suffix(path.suffix + ".gz")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as f:
        return list(csv.reader(f))


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def _opcode(source: str) -> str:
    words = source.split()
    if not words:
        return "?"
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def source_page(rows: list[list[str]]) -> list[dict]:
    """The instructions of ``ncu --page source --csv --print-source sass``: ``[{column: value}]``.
    The first row names the kernel, the second the columns."""
    header = rows[1]
    return [dict(zip(header, row)) for row in rows[2:] if len(row) == len(header)]


def block_loops(instructions: list[dict]) -> list[tuple[int, int]]:
    """``(first, last)`` instruction indices of the loops over a tile's blocks: bodies of a
    backward branch that wait for ``S`` with one product still out (``WARPGROUP.DEPBAR.LE gsb0,
    0x1``), the shortest first, none overlapping a shorter one (the loops around them do too)."""
    at = {int(ins["Address"], 16): i for i, ins in enumerate(instructions)}
    loops = []
    for i, ins in enumerate(instructions):
        target = re.search(r"BRA (0x[0-9a-f]+)", ins["Source"])
        start = at.get(int(target.group(1), 16)) if target else None
        if start is not None and start < i and i - start < LOOP_LIMIT \
                and any("gsb0, 0x1" in instructions[k]["Source"] for k in range(start, i)):
            loops.append((start, i))
    kept = []
    for first, last in sorted(loops, key=lambda loop: loop[1] - loop[0]):
        if all(last < a or b < first for a, b in kept):
            kept.append((first, last))
    return sorted(kept)


def summarize_loop(instructions: list[dict], first: int, last: int, total: float) -> dict:
    """Samples of one loop body: its share of every sample of the kernel, its shares by stall
    reason, and by opcode (each with its two main reasons)."""
    reasons = [c for c in instructions[0] if c.startswith("stall_") and "(Not Issued)" not in c]
    by_reason, by_opcode = collections.Counter(), collections.Counter()
    opcode_reasons = collections.defaultdict(collections.Counter)
    for ins in instructions[first:last + 1]:
        op = _opcode(ins["Source"])
        by_opcode[op] += _number(ins[SAMPLES])
        for reason in reasons:
            value = _number(ins[reason])
            by_reason[reason[len("stall_"):]] += value
            opcode_reasons[op][reason[len("stall_"):]] += value
    samples = sum(by_reason.values()) or 1.0
    return {"instructions": last - first + 1, "share_of_kernel_samples": samples / (total or 1.0),
            "by_reason": {r: v / samples for r, v in by_reason.most_common() if v},
            "by_opcode": {op: {"share": v / samples,
                               "main_reasons": {r: x / v for r, x in opcode_reasons[op].most_common(2) if v and x}}
                          for op, v in by_opcode.most_common(12) if v}}


def details(rows: list[list[str]]) -> dict:
    """``{section: {metric: value}}`` and the rules' findings from ``--page details --csv``."""
    header, out, rules = rows[0], collections.defaultdict(dict), []
    for row in rows[1:]:
        entry = dict(zip(header, row))
        if entry.get("Rule Name"):
            rules.append({"rule": entry["Rule Name"], "text": entry.get("Rule Description", "")})
        elif entry.get("Metric Name"):
            out[entry["Section Name"]][entry["Metric Name"]] = f"{entry['Metric Value']} {entry['Metric Unit']}".strip()
    return {"metrics": dict(out), "rules": rules}


def summarize(stem: Path) -> dict:
    """One precision's summary from ``STEM_sass.csv[.gz]`` and ``STEM_details.csv``."""
    instructions = source_page(_rows(Path(f"{stem}_sass.csv")))
    total = sum(_number(ins[SAMPLES]) for ins in instructions)
    loops = [summarize_loop(instructions, a, b, total) for a, b in block_loops(instructions)]
    return {"kernel_samples": total, "block_loops": loops, **details(_rows(Path(f"{stem}_details.csv")))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", help="NAME=STEM, e.g. native=$OUT/ncu_native")
    parser.add_argument("--device", help="the profiled GPU's name (default: this machine's, if it has one)")
    parser.add_argument("--profiled", help="what ran under ncu, kept in the JSON")
    parser.add_argument("--json")
    args = parser.parse_args()
    device = args.device
    if device is None:
        import torch

        device = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    result = {"device": device, "profiled": args.profiled, "reports": {}}
    for spec in args.reports:
        name, _, stem = spec.partition("=")
        result["reports"][name] = summarize(Path(stem))
        for loop in result["reports"][name]["block_loops"]:
            print(name, f"loop of {loop['instructions']} instructions, {loop['share_of_kernel_samples']:.2f} of samples:",
                  {r: round(v, 3) for r, v in list(loop["by_reason"].items())[:6]},
                  {op: round(v["share"], 3) for op, v in list(loop["by_opcode"].items())[:6]})
    if args.json:
        from benchmarks.common import save

        save(result, args.json)


if __name__ == "__main__":
    main()
