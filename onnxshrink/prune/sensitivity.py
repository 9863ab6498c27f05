"""Where to prune: how much each family of groups (a layer's channels, a layer's heads, a layer's
FFN neurons) costs the output when it alone is pruned, and the allocation that meets a target
with the least predicted deviation.

`measure` prunes each family alone at several ratios (its least important groups first, with the
prune's criterion and compensation) and records the relative output error on the calibration
inputs. `allocate` takes, from every family's curve of (cost removed, squared error), the lower
convex hull, and spends the budget on the hull segments of least error per unit of cost first
(errors of different families add, roughly, as squares: the greedy on convex curves is then
optimal). `write_html` draws the curves: a self-contained page, an inline SVG, one polyline per
family, and the table.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RATIOS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@dataclass
class Family:
    """A layer's exact groups, least important first, and the deviation of pruning them alone."""

    layer: int
    name: str
    kind: str
    order: list[int]  # group ids, least important first
    counts: list[int] = field(default_factory=list)  # groups removed at each measured ratio
    deviation: list[float] = field(default_factory=list)  # relative output error at each

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "name": self.name,
            "kind": self.kind,
            "units": len(self.order),
            "removed": self.counts,
            "ratios": [c / len(self.order) for c in self.counts],
            "deviation": self.deviation,
        }


def counts_at(n: int, ratios: Sequence[float], bound: Callable[[int], int] = lambda k: k) -> list[int]:
    """Groups removed of n at each ratio (as --prune removes them per layer), within `bound`,
    distinct and growing; a family of few groups (heads) at every count."""
    wanted = range(1, n) if n <= 2 * len(ratios) + 1 else (n - int(n * (1 - r)) for r in ratios)
    out: list[int] = []
    for k in wanted:
        k = bound(k)
        if k > (out[-1] if out else 0):
            out.append(k)
    return out


def measure(
    families: list[Family],
    evaluate: Callable[[list[int]], float],
    ratios: Sequence[float] = RATIOS,
    bound: Callable[[Family, int], int] = lambda f, k: k,
    say: Callable[[str], None] = lambda m: None,
    progress: bool = False,
) -> list[Family]:
    """Each family pruned alone at each ratio: `evaluate(group ids removed)` is the deviation
    (`progress`: a bar counting the evaluations, on a terminal)."""
    from onnxshrink.progress import bar

    for fam in families:
        fam.counts = counts_at(len(fam.order), ratios, lambda n, f=fam: bound(f, n))  # type: ignore[misc]
    with bar(sum(len(f.counts) for f in families), "sensitivity", "run", progress) as shown:
        for k, fam in enumerate(families):
            fam.deviation = []
            for c in fam.counts:
                fam.deviation.append(evaluate(fam.order[:c]))
                shown.update(1)
            _said(k, families, say)
    return families


def _said(k: int, families: list[Family], say: Callable[[str], None]) -> None:
    fam = families[k]
    worst = fam.deviation[-1] if fam.deviation else 0.0
    say(f"sensitivity {k + 1}/{len(families)}: {fam.name} ({fam.kind}), error {worst:.3g} at {fam.counts[-1] if fam.counts else 0} of {len(fam.order)}")


def allocate(
    families: list[Family], cost: Callable[[Family, int], float], budget: float
) -> dict[int, int]:
    """Groups to remove per family (by layer id) so that the cost removed reaches `budget` with
    the least predicted squared error: the greedy over the hull segments of every family's
    (cost, error^2) curve, the last segment cut at the group that reaches the budget."""
    segments = []
    for fam in families:
        points = [(0.0, 0.0, 0)] + [
            (cost(fam, c), d * d, c) for c, d in zip(fam.counts, fam.deviation, strict=True)
        ]
        hull = _lower_hull(points)
        for a, b in zip(hull, hull[1:], strict=False):
            if b[0] > a[0]:
                segments.append(((b[1] - a[1]) / (b[0] - a[0]), fam, a, b))
    segments.sort(key=lambda s: (s[0], s[1].layer))
    chosen = {fam.layer: 0 for fam in families}
    spent = 0.0
    for _, fam, a, b in segments:
        if spent >= budget:
            break
        if chosen[fam.layer] != a[2]:  # hull segments of one family come in order
            continue
        if spent + (b[0] - a[0]) <= budget:
            chosen[fam.layer], spent = b[2], spent + (b[0] - a[0])
            continue
        k = a[2]
        while k < b[2] and spent + cost(fam, k) - a[0] < budget:
            k += 1
        chosen[fam.layer] = k
        spent += cost(fam, k) - a[0]
    return chosen


def _lower_hull(points: list[tuple[float, float, int]]) -> list[tuple[float, float, int]]:
    """The lower convex hull of points sorted by cost (a point of no lower error than a costlier
    one is never worth stopping at)."""
    hull: list[tuple[float, float, int]] = []
    for p in sorted(points, key=lambda q: (q[0], q[1])):
        while len(hull) >= 2:
            (x1, y1, _), (x2, y2, _) = hull[-2], hull[-1]
            if (y2 - y1) * (p[0] - x1) >= (p[1] - y1) * (x2 - x1):
                hull.pop()
            else:
                break
        hull.append(p)
    return hull


def predicted(families: list[Family], chosen: dict[int, int]) -> float:
    """The predicted relative error of an allocation: the root of the summed squared errors,
    each family's interpolated on its curve."""
    total = 0.0
    for fam in families:
        k = chosen.get(fam.layer, 0)
        xs, ys = [0, *fam.counts], [0.0, *fam.deviation]
        for j in range(1, len(xs)):
            if k <= xs[j]:
                d = ys[j - 1] + (ys[j] - ys[j - 1]) * (k - xs[j - 1]) / max(xs[j] - xs[j - 1], 1)
                break
        else:
            d = ys[-1]
        total += d * d
    return math.sqrt(total)


# ---------------------------------------------------------------------- the picture
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def write_html(families: list[Family], path: str | Path, title: str, how: str) -> None:
    """A self-contained page: the deviation of each family against the ratio of it removed, as
    an inline SVG (one polyline per family, class "curve", data-family its name), and the table;
    the data again as JSON (script#sensitivity-data)."""
    svg, legend = _chart(families)
    head, rows = _table(families)
    data = json.dumps({"title": title, "how": how, "families": [f.to_dict() for f in families]})
    data = data.replace("</", "<\\/")  # JSON's escape: no "</script>" ends the block early
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}} td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}} td:first-child{{text-align:left}} ul{{columns:2;list-style:none;padding:0}}</style>
</head><body>
<h1>{html.escape(title)}</h1>
<p>{html.escape(how)}</p>
{svg}
<ul>{legend}</ul>
<table><thead><tr><th>family</th><th>kind</th><th>groups</th>{head}</tr></thead><tbody>
{rows}
</tbody></table>
<script type="application/json" id="sensitivity-data">{data}</script>
</body></html>
"""
    Path(path).write_text(page)


def _chart(families: list[Family]) -> tuple[str, str]:
    """The SVG of the curves on their axes, and its legend's items."""
    width, height, left, right, top, bottom = 760, 440, 70, 20, 20, 50
    ymax = max([d for f in families for d in f.deviation] or [0.0]) or 1.0
    ymax = _nice(ymax)

    def x(r: float) -> float:
        return left + r * (width - left - right)

    def y(d: float) -> float:
        return height - bottom - d / ymax * (height - top - bottom)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="deviation against ratio removed">',
        f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{height - top - bottom}" fill="none" stroke="#999"/>',
    ]
    for k in range(11):
        r = k / 10
        parts.append(f'<line x1="{x(r):.1f}" y1="{height - bottom}" x2="{x(r):.1f}" y2="{height - bottom + 5}" stroke="#333"/>')
        parts.append(f'<text x="{x(r):.1f}" y="{height - bottom + 18}" font-size="11" text-anchor="middle">{r:.1f}</text>')
    for k in range(6):
        d = ymax * k / 5
        parts.append(f'<line x1="{left - 5}" y1="{y(d):.1f}" x2="{width - right}" y2="{y(d):.1f}" stroke="#eee"/>')
        parts.append(f'<text x="{left - 8}" y="{y(d) + 4:.1f}" font-size="11" text-anchor="end">{d:.3g}</text>')
    parts.append(f'<text x="{(left + width - right) / 2}" y="{height - 10}" font-size="12" text-anchor="middle">ratio of the family removed</text>')
    parts.append(f'<text x="14" y="{(top + height - bottom) / 2}" font-size="12" text-anchor="middle" transform="rotate(-90 14 {(top + height - bottom) / 2})">relative output error</text>')
    legend = []
    for k, fam in enumerate(families):
        color = PALETTE[k % len(PALETTE)]
        dash = "" if k < len(PALETTE) else ' stroke-dasharray="5 3"'
        n = len(fam.order)
        pts = " ".join(f"{x(c / n):.1f},{y(d):.1f}" for c, d in zip([0, *fam.counts], [0.0, *fam.deviation], strict=True))
        label = html.escape(f"{fam.name} ({fam.kind})", quote=True)
        parts.append(
            f'<polyline class="curve" data-family="{label}" points="{pts}" fill="none" stroke="{color}" stroke-width="1.6"{dash}><title>{label}</title></polyline>'
        )
        legend.append(f'<li><span style="color:{color}">&#9632;</span> {label}</li>')
    parts.append("</svg>")
    return "".join(parts), "".join(legend)


def _table(families: list[Family]) -> tuple[str, str]:
    """The table's header cells (one per ratio measured) and its rows (one per family)."""
    ratios = sorted({round(c / len(f.order), 3) for f in families for c in f.counts})
    rows = []
    for fam in families:
        n = len(fam.order)
        cells = {round(c / n, 3): d for c, d in zip(fam.counts, fam.deviation, strict=True)}
        tds = "".join(f"<td>{cells[r]:.4g}</td>" if r in cells else "<td></td>" for r in ratios)
        rows.append(f"<tr><td>{html.escape(fam.name)}</td><td>{html.escape(fam.kind)}</td><td>{n}</td>{tds}</tr>")
    return "".join(f"<th>{r:g}</th>" for r in ratios), "".join(rows)


def _nice(v: float) -> float:
    """The round number at or above v that an axis ends at (1, 2, 2.5 or 5 times a power of ten)."""
    e = 10 ** math.floor(math.log10(v))
    return next(m * e for m in (1, 2, 2.5, 5, 10) if m * e >= v)
