"""The invariance harness: one module used by tests, notebooks and benchmarks.

Question it answers: *is row ``p`` of ``f(batch)`` bitwise equal to ``f(row p alone)``
for every batch size, every position ``p`` and every seed?*  And, as a search: *at which
batch size does ``f`` first diverge?*

Contract
--------
``make_batch(batch_size, seed)`` returns a tensor, or a tuple of tensors, whose dim 0 is
the batch (rows).  ``f(*inputs)`` returns a tensor or a tuple of tensors whose dim 0 is
the batch.  Row ``p`` alone means every input sliced ``[p:p+1]`` along dim 0 (a
contiguous one-row batch).  Comparison is on the *bits* (a NaN equals a NaN with the same
payload, ``-0.0`` differs from ``+0.0``): stricter than ``torch.equal``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from ..bitwise import bits, bitwise_equal, seeded_normal, ulp_distance
from ..device import describe

__all__ = [
    "Mismatch",
    "InvarianceReport",
    "bits",
    "bitwise_equal",
    "ulp_distance",
    "compare",
    "check_invariance",
    "first_divergence",
    "row_maker",
    "seeded_normal",
    "ClaimFailed",
    "claim",
    "claim_invariant",
    "claim_caught",
]

@dataclass
class Mismatch:
    """One (batch size, position, seed) at which a row's bits differ from the row alone."""

    batch_size: int
    position: int
    seed: int
    output: int  # index of the output tensor (for ops returning several)
    elements_differing: int
    first_index: tuple  # index within the row of the first differing element
    got: float  # value in the batch
    alone: float  # value when the row is alone
    max_ulp: int

    def __str__(self) -> str:
        return (
            f"batch {self.batch_size}, row {self.position}, seed {self.seed}, output {self.output}: "
            f"{self.elements_differing} element(s) differ, first at {self.first_index} "
            f"({self.got!r} vs {self.alone!r} alone), max {self.max_ulp} ulp"
        )


@dataclass
class InvarianceReport:
    """Structured result of :func:`check_invariance`."""

    checks: int = 0
    mismatches: list = field(default_factory=list)
    batch_sizes: tuple = ()
    seeds: tuple = ()

    @property
    def passed(self) -> bool:
        return self.checks > 0 and not self.mismatches

    @property
    def first(self) -> Mismatch | None:
        return self.mismatches[0] if self.mismatches else None

    @property
    def rows_differing(self) -> int:
        return len(self.mismatches)

    @property
    def elements_differing(self) -> int:
        return sum(m.elements_differing for m in self.mismatches)

    @property
    def max_ulp(self) -> int:
        return max((m.max_ulp for m in self.mismatches), default=0)

    @property
    def diverging_batch_sizes(self) -> list:
        return sorted({m.batch_size for m in self.mismatches})

    def summary(self) -> str:
        if self.checks == 0:
            return "no checks were run"
        if self.passed:
            return f"bitwise invariant: {self.checks} row checks, 0 differ"
        return (
            f"NOT invariant: {self.rows_differing} of {self.checks} row checks differ "
            f"({self.elements_differing} elements, max {self.max_ulp} ulp); first: {self.first}"
        )

    def __bool__(self) -> bool:  # so that ``assert report`` reads naturally
        return self.passed


class ClaimFailed(AssertionError):
    """A fact a chapter states does not hold on the present device: the cell (and with it the
    book's build or its nbval run) stops instead of publishing a contradicted claim."""


def claim(statement: str, holds, detail: str = "") -> None:
    """Print ``"<statement>: True"`` if ``holds``; otherwise raise :class:`ClaimFailed` naming the
    statement, the device and ``detail``.  Chapters state their facts through this (or the two
    helpers below), so what they print is what they asserted."""
    if not bool(holds):
        raise ClaimFailed(f"claim failed on {describe()}: {statement}" + (f" ({detail})" if detail else ""))
    print(f"{statement}: True")


def claim_invariant(label: str, report: InvarianceReport) -> None:
    """Print ``"<label>: <report summary>"`` for a report that must pass (every row bitwise equal
    to the row alone); raise :class:`ClaimFailed` with the summary otherwise."""
    if report.checks == 0 or not report.passed:
        raise ClaimFailed(f"claim failed on {describe()}: {label}: every row bitwise equal to the row alone; "
                          f"found {report.summary()}")
    print(f"{label}: {report.summary()}")


def claim_caught(label: str, report: InvarianceReport) -> None:
    """Print ``"<label> caught: True"`` for a variant twin's report, which must fail (the negative
    control); raise :class:`ClaimFailed` if the check found no difference."""
    claim(f"{label} caught", report.checks > 0 and not report.passed,
          f"the variant twin passed the same check: {report.summary()}")


def _as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def compare(got: torch.Tensor, alone: torch.Tensor, *, batch_size: int = 0, position: int = 0,
            seed: int = 0, output: int = 0) -> Mismatch | None:
    """Compare two rows bitwise; ``None`` when equal, else a :class:`Mismatch`."""
    if got.shape != alone.shape or got.dtype != alone.dtype:
        raise ValueError(
            f"compare: the row in the batch has shape {tuple(got.shape)}/{got.dtype} but alone "
            f"{tuple(alone.shape)}/{alone.dtype}"
        )
    got = got.detach().cpu()
    alone = alone.detach().cpu()
    diff = bits(got) != bits(alone)
    n = int(diff.sum())
    if n == 0:
        return None
    idx = tuple(int(i) for i in diff.nonzero()[0])
    return Mismatch(
        batch_size=batch_size, position=position, seed=seed, output=output,
        elements_differing=n, first_index=idx,
        got=float(got[idx]) if got.dtype.is_floating_point else int(got[idx]),
        alone=float(alone[idx]) if alone.dtype.is_floating_point else int(alone[idx]),
        max_ulp=int(ulp_distance(got, alone).max()),
    )


def _positions(spec, bs: int) -> list:
    if spec is None:
        return sorted({0, bs // 2, bs - 1})
    if spec == "all":
        return list(range(bs))
    if callable(spec):
        return sorted(set(int(p) for p in spec(bs)))
    out = sorted({(int(p) if p >= 0 else bs + int(p)) for p in spec})
    return [p for p in out if 0 <= p < bs]


def _validate(f, make_batch, batch_sizes, seeds):
    if not callable(f):
        raise TypeError(f"f must be callable, got {type(f).__name__}")
    if not callable(make_batch):
        raise TypeError(f"make_batch must be callable, got {type(make_batch).__name__}")
    batch_sizes = list(batch_sizes)
    if not batch_sizes:
        raise ValueError("batch_sizes is empty")
    for b in batch_sizes:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"batch_sizes must be positive ints, got {b!r}")
    seeds = list(seeds)
    if not seeds:
        raise ValueError("seeds is empty")
    return batch_sizes, seeds


def _outputs(f, inputs, what: str) -> tuple:
    out = _as_tuple(f(*inputs))
    for i, o in enumerate(out):
        if not isinstance(o, torch.Tensor):
            raise TypeError(f"f must return tensors; output {i} of {what} is {type(o).__name__}")
    return out


def _check_one(f, batch, bs, seed, positions, report, stop_at_first):
    inputs = _as_tuple(batch)
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"make_batch must return tensors; input {i} is {type(t).__name__}")
        if t.shape[0] != bs:
            raise ValueError(
                f"make_batch({bs}, seed={seed}) returned input {i} with {t.shape[0]} rows, expected {bs}"
            )
    outs = _outputs(f, inputs, f"the batch of {bs}")
    for o in outs:
        if o.shape[0] != bs:
            raise ValueError(f"f returned {o.shape[0]} rows for a batch of {bs}: dim 0 must be the batch")
    for p in _positions(positions, bs):
        alone = _outputs(f, tuple(t[p:p + 1] for t in inputs), f"row {p} alone")
        for k, (o, a) in enumerate(zip(outs, alone)):
            report.checks += 1
            m = compare(o[p], a[0], batch_size=bs, position=p, seed=seed, output=k)
            if m is not None:
                report.mismatches.append(m)
                if stop_at_first:
                    return True
    return False


def check_invariance(
    f: Callable,
    make_batch: Callable,
    batch_sizes: Iterable[int],
    *,
    positions: Sequence[int] | str | Callable | None = None,
    seeds: Iterable[int] = (0,),
    stop_at_first: bool = False,
) -> InvarianceReport:
    """Check bitwise that row ``p`` of ``f(batch)`` equals ``f(row p alone)``.

    ``positions``: ``None`` (first, middle, last row), ``"all"``, a list of row indices
    (negative counts from the end; out-of-range ones are skipped), or ``bs -> indices``.
    Returns an :class:`InvarianceReport`; ``report.passed`` is the verdict."""
    batch_sizes, seeds = _validate(f, make_batch, batch_sizes, seeds)
    report = InvarianceReport(batch_sizes=tuple(batch_sizes), seeds=tuple(seeds))
    for seed in seeds:
        for bs in batch_sizes:
            if _check_one(f, make_batch(bs, seed), bs, seed, positions, report, stop_at_first):
                return report
    return report


def first_divergence(
    f: Callable,
    make_batch: Callable,
    batch_sizes: Iterable[int],
    *,
    positions: Sequence[int] | str | Callable | None = (0,),
    seeds: Iterable[int] = (0,),
) -> tuple:
    """Search the smallest batch size (in the order given) at which ``f`` diverges.

    Returns ``(batch_size or None, report)``; the report holds every check made up to and
    including the first divergence."""
    batch_sizes, seeds = _validate(f, make_batch, batch_sizes, seeds)
    report = InvarianceReport(batch_sizes=tuple(batch_sizes), seeds=tuple(seeds))
    for bs in batch_sizes:
        for seed in seeds:
            if _check_one(f, make_batch(bs, seed), bs, seed, positions, report, True):
                return bs, report
    return None, report


def row_maker(row_shape: Sequence[int] | int, *, dtype: torch.dtype = torch.float32,
              device=None, scale: float = 1.0) -> Callable:
    """A ``make_batch`` whose row ``r`` is the same for every batch size and every machine.

    Row ``r`` of seed ``s`` is :func:`seeded_normal` of its own stream, so the batch of 300
    starts with the batch of 255 (the 255-vs-300-token test of vLLM's RMSNorm fix); rows are
    cached per seed."""
    if isinstance(row_shape, int):
        row_shape = (row_shape,)
    row_shape = tuple(int(s) for s in row_shape)
    if any(s < 1 for s in row_shape):
        raise ValueError(f"row_shape must be positive, got {row_shape}")
    if device is None:
        from ..device import DEVICE as device
    cache: dict = {}

    def one_row(seed: int, r: int) -> torch.Tensor:
        return seeded_normal(row_shape, int(seed) * 1_000_003 + r) * scale

    def make(bs: int, seed: int = 0) -> torch.Tensor:
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise ValueError(f"batch size must be a positive int, got {bs!r}")
        have = cache.get(seed)
        n = 0 if have is None else have.shape[0]
        if n < bs:
            new = torch.stack([one_row(seed, r) for r in range(n, bs)]).to(dtype=dtype, device=device)
            cache[seed] = have = new if have is None else torch.cat([have, new])
        return have[:bs]

    return make
