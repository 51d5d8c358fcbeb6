"""A planted fault: run an op's variant twin where its invariant kernel was asked for.

``KIT_PLANT_VARIANT=matmul`` (a comma-separated list of op names; ``matmul`` is the one wired in)
makes every invariant launch of that op run its batch-variant twin instead, in every process that
inherits the environment.  It exists to show that the guards work: the book's claims
(:func:`batch_invariance_kit.verify.harness.claim`), the tests and a reader's own CI must stop on
a batch-variant kernel, e.g. ``KIT_PLANT_VARIANT=matmul bash tools/kit.sh book`` fails in chapter 4
with a :class:`~batch_invariance_kit.verify.harness.ClaimFailed` naming the claim and the device.
Unset (the default), nothing changes.
"""
from __future__ import annotations

import os

#: The op names whose invariant path is replaced by the variant twin in this process.
PLANTED: frozenset = frozenset(n.strip() for n in os.environ.get("KIT_PLANT_VARIANT", "").split(",") if n.strip())


def planted(op: str) -> bool:
    """``True`` when ``op``'s variant twin has been planted in place of its invariant kernel."""
    return op in PLANTED
