"""`python -m bench --plot DIR`: one PNG per op, median time against problem size for every
implementation measured, beside the roofline floor of an H100 and a TPU v5e for the same
problems (the time the op's flops and bytes need at the device's peak: no kernel can beat it).

Sizes are the op's flops for matmul and conv2d (compute-bound), its HBM bytes for normalize and
gather (memory-bound). Interpreted rows are drawn dotted and labelled: they time the kernel's
code run by a CPU, not the kernel.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from bench.harness import DEVICES

_COMPUTE_BOUND = ("matmul", "conv2d")


def _family(row: dict) -> str:
    return row["op"].split()[0]  # "gather backward" is gather's


def plot(rows: list[dict], directory: str | Path, device: str) -> list[Path]:
    """Writes DIR/<op>.png for every op in `rows` (measured on `device`); returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    by_family = defaultdict(list)
    for row in rows:
        by_family[_family(row)].append(row)
    paths = []
    for family, family_rows in by_family.items():
        size_key = "flops" if family in _COMPUTE_BOUND else "bytes"
        figure, axis = plt.subplots(figsize=(8, 5))
        lines = defaultdict(list)
        for row in family_rows:
            if row["max_rel_err"] is not None:  # parts (a wrapper's copy) are not the op
                lines[(row["op"], row["implementation"], row["dtype"])].append(row)
        for (op, implementation, dtype), points in sorted(lines.items()):
            points.sort(key=lambda r: r[size_key])
            interpreted = "interpret" in implementation
            axis.plot([r[size_key] for r in points], [r["median_ms"] for r in points],
                      ":" if interpreted else "-", marker="o" if not interpreted else "x",
                      label=f"{op}, {implementation}{': not speed' if interpreted else ''}, "
                            f"{dtype}")
        for name in DEVICES:  # one floor line per dtype: peak flops differ by dtype
            for dtype in sorted({r["dtype"] for r in family_rows}):
                floors = sorted({(r[size_key], r[f"floor_{name}_us"] / 1e3) for r in family_rows
                                 if r["dtype"] == dtype and r[f"floor_{name}_us"] is not None})
                if floors:
                    axis.plot(*zip(*floors), "--" if dtype == "float32" else "-.",
                              color="black" if name == "H100" else "grey",
                              label=f"roofline floor, {name}, {dtype}")
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("flops" if size_key == "flops" else "HBM bytes")
        axis.set_ylabel("median time (ms)")
        axis.set_title(f"{family}: time vs size on {device}")
        axis.legend(fontsize=7)
        figure.tight_layout()
        path = directory / f"{family}.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        paths.append(path)
    return paths
