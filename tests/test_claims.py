"""A claim the book states is an assertion: it prints what it asserted, or it stops the cell with
the claim's words and the device.  A planted variant kernel (``KIT_PLANT_VARIANT=matmul``) makes the
matmul chapter stop at its invariance claim, as the book's build would."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

nbformat = pytest.importorskip("nbformat")  # the book's tools (a GPU box may run the GPU tests without them)
NotebookClient = pytest.importorskip("nbclient").NotebookClient
CellExecutionError = pytest.importorskip("nbclient.exceptions").CellExecutionError

import batch_invariance_kit  # noqa: F401
from batch_invariance_kit.device import describe
from batch_invariance_kit.verify import harness

ROOT = Path(__file__).resolve().parents[1]


def test_claim_prints_what_holds_and_raises_with_the_device(capsys):
    harness.claim("two and two make four", 2 + 2 == 4)
    assert capsys.readouterr().out == "two and two make four: True\n"
    with pytest.raises(harness.ClaimFailed) as e:
        harness.claim("two and two make five", 2 + 2 == 5, "it is four")
    assert str(e.value) == f"claim failed on {describe()}: two and two make five (it is four)"
    assert isinstance(e.value, AssertionError)


def _reports():
    make = harness.row_maker(8)
    good = harness.check_invariance(lambda x: x * 2.0, make, [1, 3])
    # a row's output depends on the batch size: the harness must see it
    bad = harness.check_invariance(lambda x: x * (1.0 + 1e-3 * x.shape[0]), make, [1, 3])
    return good, bad


def test_claim_invariant_and_claim_caught(capsys):
    good, bad = _reports()
    harness.claim_invariant("scaling", good)
    harness.claim_caught("the batch-scaled twin", bad)
    assert capsys.readouterr().out == (f"scaling: {good.summary()}\n"
                                       "the batch-scaled twin caught: True\n")
    with pytest.raises(harness.ClaimFailed, match="the batch-scaled twin: every row bitwise equal to the row alone; found NOT invariant"):
        harness.claim_invariant("the batch-scaled twin", bad)
    with pytest.raises(harness.ClaimFailed, match="scaling caught .the variant twin passed the same check"):
        harness.claim_caught("scaling", good)
    empty = harness.InvarianceReport()
    with pytest.raises(harness.ClaimFailed):
        harness.claim_invariant("nothing checked", empty)


def test_planted_variant_stops_the_matmul_chapter_at_its_claim(tmp_path):
    """Chapter 4 executed with ``KIT_PLANT_VARIANT=matmul``: the kernel is its split-K twin, the
    chapter's invariance claim fails, the cell raises ClaimFailed naming the claim and the device."""
    nb = nbformat.read(ROOT / "book" / "04_matmul.ipynb", 4)
    stop = next(i for i, c in enumerate(nb.cells) if 'claim_invariant("invariant", rep_inv)' in c.source)
    nb.cells = nb.cells[:stop + 1]
    env = {**os.environ, "KIT_PLANT_VARIANT": "matmul"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel process inherits this process's environment
    try:
        client = NotebookClient(nb, timeout=900, kernel_name="python3",
                                resources={"metadata": {"path": str(ROOT / "book")}})
        with pytest.raises(CellExecutionError) as e:
            client.execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    msg = str(e.value)
    assert "ClaimFailed" in msg and "claim failed on" in msg and "invariant: every row bitwise equal to the row alone; found NOT invariant" in msg, msg[-3000:]

