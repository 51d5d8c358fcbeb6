"""A planted fault: run an op's variant twin where its invariant kernel was asked for.

``KIT_PLANT_VARIANT=matmul`` (a comma-separated list of op names: those of :data:`PLANTABLE`)
makes every invariant launch of that op run its batch-variant twin instead, in every process that
inherits the environment and imports :mod:`batch_invariance_kit.verify` (the book's chapters and
the tests do).  It exists to show that the guards work: the book's claims
(:func:`batch_invariance_kit.verify.harness.claim`), the tests and a reader's own CI must stop on
a batch-variant kernel, e.g. ``KIT_PLANT_VARIANT=matmul bash tools/kit.sh book`` fails in chapter 4
with a :class:`~batch_invariance_kit.verify.harness.ClaimFailed` naming the claim and the device.
Unset (the default), nothing changes and no kernel module is imported from here.

The kernels know nothing of this module: the op exposes a switch
(:func:`batch_invariance_kit.ops.matmul.plant_variant`) and :func:`register` turns it on.
"""
from __future__ import annotations

import importlib
import os

#: The op names whose invariant path is replaced by the variant twin in this process.
PLANTED: frozenset = frozenset(n.strip() for n in os.environ.get("KIT_PLANT_VARIANT", "").split(",") if n.strip())

#: op name -> ``"module:function"`` under :mod:`batch_invariance_kit.ops` that plants its variant
PLANTABLE = {"matmul": "matmul:plant_variant"}


def planted(op: str) -> bool:
    """``True`` when ``op``'s variant twin has been planted in place of its invariant kernel."""
    return op in PLANTED


def register(names=None) -> list:
    """Turn on the variant switch of each op in ``names`` (default: :data:`PLANTED`, from the
    environment); names that no op answers to are ignored.  Returns the ops switched."""
    done = []
    for name in sorted(PLANTED if names is None else names):
        if name in PLANTABLE:
            module, fn = PLANTABLE[name].split(":")
            getattr(importlib.import_module(f"batch_invariance_kit.ops.{module}"), fn)(True)
            done.append(name)
    return done


if PLANTED:
    register()
