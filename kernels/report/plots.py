"""The book's figures and tables: one style, one colour per role, one speed convention.

Every chapter draws through these helpers, so a reader sees the same conventions everywhere:

* **Colours by role** (:data:`COLORS`): the kit's *invariant* kernel is always blue, its
  *variant* twin (the production-like, batch-dependent launch) always red, a *peer* (a vendor or
  compiler kernel with no invariance guarantee: cuBLAS, ``torch.compile``, SDPA,
  FlashAttention-3, vLLM's default mode) always grey, and a goal line always black and dashed.
  Another implementation of the same role keeps the role's colour and changes its marker.
* **Speed** is the *speed ratio* of :mod:`batch_invariance_kit.report.cost`: the time of the
  fastest implementation without an invariance guarantee, measured in the same run, divided by
  the implementation's own time. Higher is better; 1 is parity with the fastest peer.
* **Size**: figures are drawn for a column about 700 px wide (7 inches at 100 dpi) with fonts
  that stay legible there; wide tables are rendered as HTML tables (:func:`table`).
"""
from __future__ import annotations

import html
import math

import matplotlib as mpl
import matplotlib.pyplot as plt

from . import cost

#: One colour per role, across the whole book.
COLORS = {"invariant": "#1f5fbf", "variant": "#c8312b", "peer": "#7a7a7a", "goal": "#000000"}
#: Markers that tell apart implementations of one role (first, second, ... of that role).
MARKERS = ["o", "s", "^", "D", "v", "x"]
#: Figure width in inches: 7 inches at 100 dpi fill the book's ~700 px column.
WIDTH = 7.0
DPI = 100


def style() -> None:
    """Set matplotlib for the book's column (call once per chapter, before the first figure)."""
    mpl.rcParams.update({
        "figure.figsize": (WIDTH, 3.6), "figure.dpi": DPI, "savefig.dpi": DPI,
        "font.size": 10, "axes.titlesize": 10, "axes.labelsize": 10, "legend.fontsize": 8.5,
        "xtick.labelsize": 9, "ytick.labelsize": 9, "axes.grid": True, "grid.alpha": 0.3,
        "figure.constrained_layout.use": True,
    })


def role(impl: str) -> str:
    """``invariant``, ``variant`` or ``peer`` for an implementation name of a stored benchmark
    (``kit-invariant``, ``triton-variant``, ``cublas``, ``sdpa-gathered``, ...)."""
    if not isinstance(impl, str):
        raise TypeError(f"impl must be a str, got {type(impl).__name__}")
    if "variant" in impl and "invariant" not in impl:
        return "variant"
    return "invariant" if cost.is_invariant(impl) else "peer"


def line_style(impl: str, index: int = 0) -> dict:
    """matplotlib keyword arguments for ``impl``: its role's colour, a marker by ``index``
    (the implementation's rank within its role), solid for invariant, dashed otherwise."""
    r = role(impl)
    return {"color": COLORS[r], "marker": MARKERS[index % len(MARKERS)], "ms": 5,
            "ls": "-" if r == "invariant" else ("--" if r == "variant" else ":"), "lw": 1.6}


def speed_ratios(row: dict) -> dict:
    """{implementation: speed ratio} for one row of :func:`cost.summary`: the invariant kernel
    and every non-invariant peer, each against the fastest peer of the cell (so that peer is 1)."""
    best = row["peer_value"]
    inverse = row["unit"] == "us"
    out = {row["invariant"]: row["speed_ratio"]}
    for name, v in row["peers"].items():
        out[name] = best / v if inverse else v / best
    return out


def _label(impl: str) -> str:
    return impl.split(":")[0] if impl.startswith("kit-invariant:") else impl


def speed_figure(rows: list[dict], family: str, x: str, panel: str | None = None, *,
                 xlabel: str | None = None, title: str = "", log2x: bool = True, ncols: int = 2,
                 height: float = 2.9):
    """The speed ratio of the invariant kernel and of each peer against the fastest
    non-invariant peer, over ``x`` (a key of the rows' ``params``), one panel per value of
    ``panel`` (another key, a tuple of keys, or None), with the family's goal of :data:`cost.GOALS` as a dashed
    line over the cells it names.  Returns the figure."""
    fam = [r for r in rows if r["family"] == family]
    if not fam:
        raise ValueError(f"family {family!r} has no rows in the stored results")
    names = (panel,) if isinstance(panel, str) else tuple(panel or ())
    pkey = lambda r: tuple(r["params"][p] for p in names)
    keys = sorted({pkey(r) for r in fam})
    n = len(keys)
    cols = min(ncols, n)
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(WIDTH, height * nrows), sharey=True, squeeze=False)
    goals = [g for g in cost.GOALS if g["family"] == family and g["metric"] != "fraction_of_copy"]
    for ax, key in zip(axes.flat, keys):
        sub = sorted((r for r in fam if pkey(r) == key), key=lambda r: r["params"][x])
        xs = [r["params"][x] for r in sub]
        series: dict = {}
        for r in sub:
            inv = r["invariant"]
            for name, v in speed_ratios(r).items():
                series.setdefault("kit-invariant" if name == inv else name, {})[r["params"][x]] = v
        rank = {"invariant": 0, "variant": 0, "peer": 0}
        for name, pts in sorted(series.items(), key=lambda kv: ("invariant", "variant", "peer").index(role(kv[0]))):
            k = sorted(pts)
            ax.plot(k, [pts[i] for i in k], label=_label(name), **line_style(name, rank[role(name)]))
            rank[role(name)] += 1
        for g in goals:
            scope = [r["params"][x] for r in sub if g["scope"](r["params"])]
            if scope:
                ax.hlines(g["threshold"], min(scope), max(scope), color=COLORS["goal"], ls="--", lw=1.2,
                          label=f"goal: {g['short']}")
        ax.axhline(1.0, color=COLORS["goal"], lw=0.6)
        if log2x:
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [f"{v // 1024}k" if v >= 1024 and v % 1024 == 0 else str(v) for v in xs])
            ax.minorticks_off()
        ax.set_xlabel(xlabel or x)
        if names:
            ax.set_title(", ".join(f"{p} {v}" for p, v in zip(names, key)))
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel("speed ratio (higher is better)")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=min(4, len(labels)), frameon=False)
    if title:
        fig.suptitle(title)
    return fig


class table:
    """A table that renders as HTML in the book (columns fit the page, no scroll bar) and as
    aligned text elsewhere (the text form is what nbval compares).

        table(["op", "rows differing"], [["rms_norm", 0], ...], caption="...")
    """

    def __init__(self, header, rows, caption: str | None = None, floatfmt: str = "{:.2f}"):
        if not header:
            raise ValueError("header must name at least one column")
        self.header = [str(h) for h in header]
        self.rows = [[self._fmt(v, floatfmt) for v in row] for row in rows]
        for i, row in enumerate(self.rows):
            if len(row) != len(self.header):
                raise ValueError(f"rows[{i}] has {len(row)} cells, the header {len(self.header)}")
        self.caption = caption

    @staticmethod
    def _fmt(v, floatfmt):
        if isinstance(v, float):
            return floatfmt.format(v)
        return "-" if v is None else str(v)

    def __repr__(self) -> str:
        w = [max(len(c) for c in col) for col in zip(self.header, *self.rows)]
        lines = [self.caption] if self.caption else []
        lines.append("  ".join(h.ljust(n) for h, n in zip(self.header, w)).rstrip())
        lines += ["  ".join(c.ljust(n) for c, n in zip(row, w)).rstrip() for row in self.rows]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        num = [all(_numeric(r[j]) for r in self.rows) for j in range(len(self.header))]
        esc = html.escape
        head = "".join(f"<th style='text-align:{'right' if n else 'left'}'>{esc(h)}</th>"
                       for h, n in zip(self.header, num))
        body = "".join("<tr>" + "".join(f"<td style='text-align:{'right' if n else 'left'}'>{esc(c)}</td>"
                                        for c, n in zip(row, num)) + "</tr>" for row in self.rows)
        cap = f"<caption style='caption-side:top;text-align:left'>{esc(self.caption)}</caption>" if self.caption else ""
        return (f"<table class='kit-table' style='font-size:0.85em;border-collapse:collapse'>{cap}"
                f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


def _numeric(s: str) -> bool:
    s = s.rstrip("x%").replace(",", "")
    try:
        float(s)
        return True
    except ValueError:
        return s in ("-", "")
