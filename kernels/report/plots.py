"""The book's figures and tables: one style, one colour per role, one speed convention.

Every chapter draws through these helpers, so a reader sees the same conventions everywhere:

* **Colours by role** (:data:`COLORS`): the kit's *invariant* kernel is always blue, its
  *variant* twin (the production-like, batch-dependent launch) always red, a *peer* (a vendor or
  compiler kernel with no invariance guarantee: cuBLAS, ``torch.compile``, SDPA,
  FlashAttention-3, vLLM's default mode) always grey, and a goal line always black and dashed.
  **One distinct colour and marker per line**: a second implementation of a role takes the next
  shade of the role's family (:data:`SHADES`: blues, reds and oranges, greys) and the next marker
  of the figure, so no two lines of a figure look alike.
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
import numpy as np
import torch

from . import cost

#: One colour per role, across the whole book.
COLORS = {"invariant": "#1f5fbf", "variant": "#c8312b", "peer": "#7a7a7a", "goal": "#000000"}
#: Shades of each role's colour: the first, second, ... implementation of a role in one figure.
SHADES = {"invariant": ["#1f5fbf", "#5aa0e6", "#0b2e6b", "#7fb8c9"],
          "variant": ["#c8312b", "#ec8a23", "#8e1b4f", "#f2b6a0"],
          "peer": ["#7a7a7a", "#2e2e2e", "#b3b3b3", "#5c6b5c"],
          "goal": ["#000000"]}
#: Markers: one per line of a figure (the figure's first, second, ... line).
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "<", ">", "h"]
#: The H200's ceilings every cost is stated against: the device-to-device copy bandwidth (bytes
#: read + written per second, GB/s) and the dense bf16 tensor-core rate (TF/s).
H200_COPY_GBS = 4270.0
H200_BF16_TFLOPS = 790.0
#: Figure width in inches: 7 inches at 100 dpi fill the book's ~700 px column.
WIDTH = 7.0
DPI = 100


def style() -> None:
    """Set matplotlib for the book's column (call once per chapter, before the first figure)."""
    mpl.rcParams.update({
        "figure.figsize": (WIDTH, 3.6), "figure.dpi": DPI, "savefig.dpi": DPI,
        "font.size": 10, "axes.titlesize": 10, "axes.labelsize": 10, "legend.fontsize": 8.5,
        "xtick.labelsize": 9, "ytick.labelsize": 9, "axes.grid": False, "grid.alpha": 0.3,
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


def line_style(impl: str, index: int = 0, marker_index: int | None = None) -> dict:
    """matplotlib keyword arguments for ``impl``: the ``index``-th shade of its role's colour
    (the implementation's rank within its role in the figure), the ``marker_index``-th marker
    (the line's rank in the figure; ``index`` when not given), solid for invariant, dashed for
    a variant, dotted for a peer."""
    r = role(impl)
    m = index if marker_index is None else marker_index
    return {"color": SHADES[r][index % len(SHADES[r])], "marker": MARKERS[m % len(MARKERS)], "ms": 5,
            "ls": "-" if r == "invariant" else ("--" if r == "variant" else ":"), "lw": 1.6}


def mode_style(mode: str, marker_index: int | None = None) -> dict:
    """matplotlib keyword arguments for a vLLM mode (:data:`batch_invariance_kit.vllm.records.MODES`),
    the same in every figure: vLLM as installed is the peer (grey, dotted); vLLM's own invariant
    mode and the kit's modes are invariant implementations, the first, second and third shade of
    the invariant colour (solid); each mode its own marker (``marker_index`` overrides it, for a
    figure with more lines than modes).  A kit mode without vLLM's own mode under it (its
    :func:`~batch_invariance_kit.vllm.records.label` ``<mode> alone``) keeps its mode's colour and
    marker, dash-dotted."""
    from ..vllm.records import MODES, ROLE, variant_of

    mode, under = variant_of(mode)
    r = ROLE[mode]
    shade = [m for m in MODES if ROLE[m] == r].index(mode)
    m = MODES.index(mode) if marker_index is None else marker_index
    return {"color": SHADES[r][shade % len(SHADES[r])], "marker": MARKERS[m % len(MARKERS)], "ms": 5,
            "ls": ("-." if under is False else "-") if r == "invariant" else ":", "lw": 1.6}


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


def speed_figure(rows: list[dict], family, x: str, panel=None, *,
                 xlabel: str | None = None, title: str = "", log2x: bool = True, ncols: int = 2,
                 height: float = 2.9):
    """The speed ratio of the invariant kernel and of each peer against the fastest
    non-invariant peer, over ``x`` (a key of the rows' ``params``), one panel per value of
    ``panel`` (another key, a tuple of keys, or None), with the family's goal of :data:`cost.GOALS` as a dashed
    line over the cells it names.  ``family`` may be a list of families: one panel each.
    Returns the figure."""
    families = [family] if isinstance(family, str) else list(family)
    fam = [r for r in rows if r["family"] in families]
    for f in families:
        if not any(r["family"] == f for r in fam):
            raise ValueError(f"family {f!r} has no rows in the stored results")
    names = (panel,) if isinstance(panel, str) else tuple(panel or ())
    if len(families) > 1:
        names = ("family",) + names
    pkey = lambda r: tuple(r["family"] if p == "family" else r["params"][p] for p in names)
    keys = sorted({pkey(r) for r in fam}, key=lambda k: (families.index(k[0]),) + k[1:] if len(families) > 1 else k)
    n = len(keys)
    cols = min(ncols, n)
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(WIDTH, height * nrows), sharey=True, squeeze=False)
    goals = [g for g in cost.GOALS if g["family"] in families and g["metric"] != "fraction_of_copy"]
    # one style per implementation across the panels: its role's shade by rank, its own marker
    names_all = []
    for r in fam:
        for name in speed_ratios(r):
            name = "kit-invariant" if name == r["invariant"] else name
            if name not in names_all:
                names_all.append(name)
    order = sorted(names_all, key=lambda n: (("invariant", "variant", "peer").index(role(n)), names_all.index(n)))
    rank = {"invariant": 0, "variant": 0, "peer": 0}
    styles = {}
    for j, name in enumerate(order):
        styles[name] = line_style(name, rank[role(name)], marker_index=j)
        rank[role(name)] += 1
    for ax, key in zip(axes.flat, keys):
        sub = sorted((r for r in fam if pkey(r) == key), key=lambda r: r["params"][x])
        xs = [r["params"][x] for r in sub]
        series: dict = {}
        for r in sub:
            inv = r["invariant"]
            for name, v in speed_ratios(r).items():
                series.setdefault("kit-invariant" if name == inv else name, {})[r["params"][x]] = v
        for name in sorted(series, key=order.index):
            pts = series[name]
            k = sorted(pts)
            ax.plot(k, [pts[i] for i in k], label=_label(name), **styles[name])
        for g in (g for g in goals if g["family"] == sub[0]["family"]):
            scope = [r["params"][x] for r in sub if g["scope"](r["params"])]
            if scope:
                ax.hlines(g["threshold"], min(scope), max(scope), color=COLORS["goal"], ls="--", lw=1.2,
                          label=f"goal: {g['short']}")
        ax.axhline(1.0, color=COLORS["goal"], lw=0.6)
        ax.grid(True)
        if log2x:
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [f"{v // 1024}k" if v >= 1024 and v % 1024 == 0 else str(v) for v in xs])
            ax.minorticks_off()
            if len(xs) > 8:
                ax.tick_params(axis="x", labelrotation=50, labelsize=8)
        ax.set_xlabel(xlabel or x)
        if names:
            ax.set_title(", ".join(str(v) if p == "family" else f"{p} {v}" for p, v in zip(names, key)))
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel("speed ratio (higher is better)")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=min(4, len(labels)), frameon=False)
    if title:
        fig.suptitle(title)
    return fig


#: The columns of :func:`bounds`.
BOUND_HEADER = ["family", "bound", "best cell", "of the bound", "worst cell", "of the bound"]


def _span(values, fmt="{:.0%}") -> str:
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}–{hi}"


def bounds(docs: dict) -> list:
    """One row per kernel family (:data:`BOUND_HEADER`): the family's bound on the H200 (bytes
    over the copy bandwidth for kernels that stream memory, FLOPs over the bf16 dense rate for
    kernels that compute) and the fraction of it the kit's invariant kernel reaches in its best
    and its worst cell.  ``docs``: stored results by file name (``{"rms_norm_bench.json": doc,
    ...}``, as :func:`cost.sources` names them); a family whose file is absent has no row.
    RMSNorm is stated against the copy ceiling its own run measured; the rest against
    :data:`H200_COPY_GBS` and :data:`H200_BF16_TFLOPS`."""
    from ..bench import attention as AB  # the benchmark's shapes: the bytes it moved
    from . import results

    copy, peak = H200_COPY_GBS, H200_BF16_TFLOPS
    out = []
    rb = docs.get("rms_norm_bench.json")
    if rb:
        for op in ("rms_norm", "fused_add_rms_norm"):
            best = {}
            for r in rb["rows"]:
                if r["op"] == op and cost.is_invariant(r["impl"]) and r.get("median_us"):
                    if r["tokens"] not in best or r["median_us"] < best[r["tokens"]]["median_us"]:
                        best[r["tokens"]] = r
            big = [r["fraction_of_copy"] for t, r in best.items() if t >= 16384]
            out.append([op, "bytes (copy)", "T >= 16384", _span(big), "T = 1", _span([best[min(best)]["fraction_of_copy"]])])
    sw = docs.get("matmul_sweep.json")
    if sw:
        pick = [r for r in sw["rows"] if r.get("selected")]
        out.append(["matmul", "bytes (copy)", "M <= 16", _span([r["gbs"] / copy for r in pick if r["M"] <= 16]), "", ""])
        out.append(["matmul", "bf16 FLOPs", "M = 4096", _span([r["tflops"] / peak for r in pick if r["M"] == 4096]),
                    "M = 64", _span([r["tflops"] / peak for r in pick if r["M"] == 64])])
    mb = docs.get("moe_bench.json")
    if mb:
        inv = {r["tokens"]: r for r in mb["rows"] if r["impl"] == "kit-invariant" and r.get("median_us")}
        loads = docs.get("moe_loads.json") or results.load("moe_loads")
        active = {r["tokens"]: r["experts"] - r["experts_idle"] for r in loads["rows"] if r["routing"] == "uniform"} if loads else {}
        if 1 in active and 1 in inv:
            one = active[1] * 3 * inv[1]["hidden"] * inv[1]["inter"] * 2 / inv[1]["median_us"] / 1e3 / copy
            out.append(["moe", "bytes (copy)", "T = 1", _span([one]), "", ""])
        out.append(["moe", "bf16 FLOPs", f"T = {max(inv)}", _span([inv[max(inv)]["tflops"] / peak]), "", ""])
    ab = docs.get("attention_bench.json")
    if ab:
        dec = [r for r in ab["rows"] if r["op"] == "attention_decode" and r["impl"] == "kit-invariant"]
        frac = {(r["batch"], r["context"]): r["batch"] * r["context"] * 2 * AB.HKV * AB.D * 2 / r["median_us"] / 1e3 / copy
                for r in dec}
        top, low = max(frac, key=frac.get), min(frac, key=frac.get)
        out.append(["attention decode", "bytes (KV cache)", f"batch {top[0]} x context {top[1]}", _span([frac[top]]),
                    f"batch {low[0]} x context {low[1]}", _span([frac[low]])])
    return out


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


def cost_overview(rows: list[dict]):
    """Every cell of every family of :func:`cost.summary` as one point at its speed ratio, with
    the families' goals (dashed) over the families they apply to.  Filled: a cell inside a goal's
    scope; hollow: outside any speed-ratio goal; a cross: not like-for-like (eager against
    compiled).  Returns the figure."""
    fams = [f for f in cost.FAMILIES if any(r["family"] == f for r in rows)]
    if not fams:
        raise ValueError("rows holds no family of cost.FAMILIES")
    goals = [g for g in cost.GOALS if g["metric"] != "fraction_of_copy" and g["family"] in fams]
    in_scope = lambda r: any(g["family"] == r["family"] and g["scope"](r["params"]) for g in goals)
    fig, ax = plt.subplots(figsize=(WIDTH, 4.2))
    c = COLORS["invariant"]
    for i, fam in enumerate(fams):
        fr = [r for r in rows if r["family"] == fam]
        xs = [i + d for d in ((k / max(1, len(fr) - 1) - 0.5) * 0.56 for k in range(len(fr)))] if len(fr) > 1 else [i]
        for x, r in zip(xs, fr):
            odd = not r.get("like_for_like", True)
            ax.scatter(x, r["speed_ratio"], s=26, marker="x" if odd else "o", color=c,
                       facecolors=c if (in_scope(r) or odd) else "none", linewidths=1.2)
        for g in (g for g in goals if g["family"] == fam):
            ax.hlines(g["threshold"], i - 0.4, i + 0.4, color=COLORS["goal"], ls="--", lw=1.3)
    ax.axhline(1.0, color=COLORS["goal"], lw=0.7)
    ax.set_yscale("log")
    ticks = [0.25, 0.5, 0.75, 1, 1.5, 2]
    ax.set_yticks(ticks, [str(t) for t in ticks])
    ax.yaxis.set_minor_formatter(mpl.ticker.NullFormatter())
    ax.set_xticks(range(len(fams)), [f.replace("_", "_\n", 1).replace(" ", "\n", 1) for f in fams], fontsize=8)
    ax.set_ylabel("speed ratio (higher is better)")
    ax.scatter([], [], marker="o", color=c, label="cell inside a goal's scope")
    ax.scatter([], [], marker="o", facecolors="none", color=c, label="cell outside any speed-ratio goal")
    ax.scatter([], [], marker="x", color=c, label="not like-for-like (eager vs compiled)")
    ax.plot([], [], color=COLORS["goal"], ls="--", label="goal, over its family")
    fig.legend(loc="outside lower center", ncols=2, frameon=False)
    ax.grid(axis="y")
    return fig


def copy_fraction_figure(rows: list[dict]):
    """The fastest invariant RMSNorm kernels as a fraction of the copy bandwidth, against the
    token count, with the copy-bandwidth goal of :data:`cost.GOALS` over its scope."""
    goals = [g for g in cost.GOALS if g["metric"] == "fraction_of_copy"]
    fig, ax = plt.subplots(figsize=(WIDTH, 3.2))
    for j, g in enumerate(goals):
        fr = sorted((r for r in rows if r["family"] == g["family"]), key=lambda r: r["params"]["tokens"])
        if not fr:
            continue
        t = [r["params"]["tokens"] for r in fr]
        ax.plot(t, [r["fraction_of_copy"] for r in fr], label=g["family"],
                **line_style("kit-invariant", j))
        lo = min(r["params"]["tokens"] for r in fr if g["scope"](r["params"]))
        ax.hlines(g["threshold"], lo, max(t), color=COLORS["goal"], ls="--", lw=1.3,
                  label=f"goal: {g['short']}" if j == 0 else None)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens (hidden 4096, bf16)")
    ax.set_ylabel("fraction of copy bandwidth")
    ax.grid(True)
    ax.legend(loc="lower right")
    return fig


def engine_bars(e2e: dict | None, vllm: dict | None):
    """Tokens per second of the kit's serving loop (variant against invariant kernels) and of
    vLLM per mode, one panel each (hatched: run eagerly)."""
    fig, axes = plt.subplots(1, 2, figsize=(WIDTH, 3.2))
    if e2e:
        models = list(dict.fromkeys(r["model"] for r in e2e["rows"]))
        impls = list(dict.fromkeys(r["impl"] for r in e2e["rows"]))
        w = 0.8 / len(impls)
        for j, impl in enumerate(impls):
            v = [next(r["tokens_per_s"] for r in e2e["rows"] if r["model"] == m and r["impl"] == impl) for m in models]
            axes[0].bar([i + (j - (len(impls) - 1) / 2) * w for i in range(len(models))], v, w, label=impl,
                        color=COLORS[role(impl)])
        axes[0].set_xticks(range(len(models)), models)
        axes[0].set_ylabel("tokens/s under load")
        axes[0].set_title("kit serving loop (one run)")
        axes[0].legend(fontsize=8)
    if vllm:
        tp = [r for r in vllm["rows"] if r["op"] == "vllm_throughput"]
        models = list(dict.fromkeys(r["model"] for r in tp))
        modes = list(dict.fromkeys(r["impl"] for r in tp))
        w = 0.8 / len(modes)
        for j, mode in enumerate(modes):
            sel = [next(r for r in tp if r["model"] == m and r["impl"] == mode) for m in models]
            eager = any(r["engine"].get("enforce_eager") for r in sel)
            colour = mode_style(mode)["color"]
            axes[1].bar([i + (j - (len(modes) - 1) / 2) * w for i in range(len(models))],
                        [r["output_tokens_per_s"] for r in sel], w, color=colour, edgecolor="white",
                        hatch="//" if eager else None, label=mode + (" (eager)" if eager else ""))
        axes[1].set_xticks(range(len(models)), models)
        axes[1].set_ylabel("output tokens/s")
        axes[1].set_title(f"vLLM {vllm['provenance'].get('vllm')} (one run per mode)")
        axes[1].legend(fontsize=8)
    for a in axes:
        a.grid(axis="y")
        a.set_ylim(top=a.get_ylim()[1] * 1.3)  # room for the legend above the bars
    return fig


# ---------------------------------------------------------------------------------------------
# What invariance buys (chapter 9): RL and speculative decoding
# ---------------------------------------------------------------------------------------------

def sampler_trainer_figure(runs: list):
    """Two panels for :func:`batch_invariance_kit.serving.rl.sampler_vs_trainer` results (variant and invariant runs at several
    loads): the distribution of per-token ``|log p_sampler - log p_trainer|`` of the variant
    runs, and the mean per-token KL against the load (mean sequences per step of the rollouts).
    Exact zeros are drawn on a dotted floor line (a log axis has no 0), a decade below the
    smallest non-zero mean KL drawn, so "exactly 0" is always the lowest line of the panel."""
    positive = [v for v in (float(r["kl"].mean()) for r in runs) if v > 0]
    floor = 10.0 ** (math.floor(math.log10(min(positive))) - 1) if positive else 1e-12
    fig, axes = plt.subplots(1, 2, figsize=(WIDTH, 3.2))
    var = [r for r in runs if r["impl"] == "variant"]
    d = torch.cat([r["logprob_diff"].abs() for r in var]).numpy()
    nz = d[d > 0]
    if len(nz):
        bins = np.logspace(np.log10(nz.min()) - 0.2, np.log10(nz.max()) + 0.2, 20)
        axes[0].hist(nz, bins=bins, color=COLORS["variant"], alpha=0.8, label=f"variant: {len(nz)} of {len(d)} tokens")
        axes[0].legend(fontsize=8)
        axes[0].set_xscale("log")
    else:
        axes[0].text(0.5, 0.5, "variant: every sampled token's log-prob\nequal to the trainer's; the rows\n"
                     "differ in other entries (KL > 0)", ha="center", va="center", transform=axes[0].transAxes,
                     fontsize=8)
    axes[0].set_xlabel("|Δ log-prob| of the sampled token")
    axes[0].set_ylabel("tokens")
    inv = [r for r in runs if r["impl"] == "invariant"]
    if inv:
        n0 = sum(int((r["logprob_diff"] == 0).sum()) for r in inv)
        axes[0].set_title(f"sampler vs trainer (invariant: Δ = 0 for {n0} of "
                          f"{sum(len(r['logprob_diff']) for r in inv)} tokens)", fontsize=9)
    for impl in ("variant", "invariant"):
        rs = sorted((r for r in runs if r["impl"] == impl), key=lambda r: r["mean_seqs_per_step"])
        if not rs:
            continue
        x = [r["mean_seqs_per_step"] for r in rs]
        y = [float(r["kl"].mean()) for r in rs]
        axes[1].plot(x, [v if v > 0 else floor for v in y], "o--" if impl == "variant" else "s-",
                     color=COLORS[impl], label=impl)
    axes[1].axhline(floor, color="k", ls=":", lw=0.8)
    axes[1].text(0.99, floor, f"exactly 0 (drawn at {floor:.0e})", ha="right", va="bottom",
                 transform=axes[1].get_yaxis_transform(), fontsize=8)
    axes[1].set_yscale("log")
    axes[1].set_xlabel("load: sequences per step (mean over the rollouts' steps)")
    axes[1].set_ylabel("mean KL per token")
    axes[1].set_title("KL(sampler || trainer) vs load (dotted: exactly 0)", fontsize=9)
    axes[1].legend(fontsize=8)
    return fig


def ratio_figure(histories: dict):
    """Histogram of every token's log importance ratio ``log p_trainer - log p_sampler`` over
    the steps of :func:`batch_invariance_kit.serving.rl.policy_gradient`, one colour per kernel set (``{impl: history}``)."""
    fig, ax = plt.subplots(figsize=(WIDTH, 3.0))
    logs = {impl: torch.log(torch.cat([h["ratios"] for h in hist])).numpy() for impl, hist in histories.items()}
    span = max(float(np.abs(v).max()) for v in logs.values()) or 1.0
    bins = np.linspace(-span * 1.05, span * 1.05, 41)
    for impl, v in logs.items():
        exact = int((v == 0).sum())
        ax.hist(v, bins=bins, color=COLORS.get(impl, "k"), alpha=0.6,
                label=f"{impl}: ratio exactly 1 for {exact} of {len(v)} tokens")
    ax.set_xlabel("log importance ratio  log p_trainer − log p_sampler")
    ax.set_ylabel("tokens")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    return fig


def speculation_figure(runs: dict):
    """Bars for serving runs of the same requests, ``{label: {"steps", "seconds", "drafted",
    "accepted"}}`` (plain decoding: ``drafted = 0``): engine steps and wall seconds, and the
    acceptance rate of the speculative runs."""

    labels = list(runs)
    fig, axes = plt.subplots(1, 2, figsize=(WIDTH, 3.2))
    x = range(len(labels))
    axes[0].bar([i - 0.2 for i in x], [runs[k]["steps"] for k in labels], 0.4, color=COLORS["invariant"],
                label="engine steps")
    ax2 = axes[0].twinx()
    ax2.bar([i + 0.2 for i in x], [runs[k]["seconds"] for k in labels], 0.4, color=COLORS["peer"],
            label="wall seconds")
    ax2.set_ylabel("seconds")
    axes[0].set_xticks(list(x), labels, fontsize=8, rotation=20, ha="right")
    axes[0].set_ylabel("steps")
    axes[0].set_title("serving the same requests", fontsize=9)
    h1, l1 = axes[0].get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    axes[0].legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
    spec = [k for k in labels if runs[k]["drafted"]]
    axes[1].bar(range(len(spec)), [runs[k]["accepted"] / runs[k]["drafted"] for k in spec], 0.5,
                color=COLORS["invariant"])
    axes[1].set_xticks(range(len(spec)), spec, fontsize=8, rotation=20, ha="right")
    axes[1].set_ylim(0, 1)
    axes[1].set_ylabel("accepted / drafted")
    axes[1].set_title("acceptance rate of the drafts", fontsize=9)
    return fig


#: What :func:`moe_vs_vllm` prints when no comparison with vLLM is stored
NO_MOE_VS_VLLM = ("No stored comparison with vLLM's fused_moe (moe_vs_vllm.json): run "
                  "`python -m batch_invariance_kit.validate --only moe_vs_vllm` on a GPU with vLLM's CUDA build.")


def moe_vs_vllm(where: str = "h200", root=None):
    """Chapter 5's figure of the kit's invariant MoE layer against vLLM's default Triton
    ``fused_moe``: the speed ratio over the token count, one panel per model, the goal dashed.
    Reads the stored ``moe_vs_vllm.json`` of ``results/<where>/``; when it is absent, prints
    :data:`NO_MOE_VS_VLLM` and returns None.  Returns the figure."""
    from . import results

    if results.load("moe_vs_vllm", where, root) is None:
        print(NO_MOE_VS_VLLM)
        return None
    rows = [r for r in cost.summary(where, root) if r["family"] == "moe vs vLLM"]
    return speed_figure(rows, "moe vs vLLM", "tokens", panel="model", xlabel="tokens",
                        title="MoE layer: the kit's invariant kernels vs vLLM's fused_moe, bf16")

