"""Guard regions for kernel outputs.

The Triton interpreter does not bounds-check: an unmasked store past the end of a buffer
silently corrupts memory and the process aborts later, at random.  Tests therefore
allocate every output inside a larger buffer whose margins hold a poison value, and check
the margins after each launch (on the GPU as well: it catches out-of-bounds writes that
land in the margins).
"""
from __future__ import annotations

import torch

from .harness import bits


def _poison(dtype: torch.dtype) -> float | int:
    if dtype.is_floating_point:
        return float("nan") if dtype in (torch.float8_e4m3fn,) else -12345.0
    return -7


class Guarded:
    """An output tensor of ``shape`` with ``margin`` poisoned elements on each side.

    ``.tensor`` is the view a kernel may write; ``.check()`` raises ``AssertionError``
    naming the side if any margin element changed; ``.unwritten()`` counts elements of
    the view that still hold the poison (kernels must write every output element)."""

    def __init__(self, shape, dtype: torch.dtype, device, margin: int = 4096):
        shape = tuple(int(s) for s in shape)
        n = 1
        for s in shape:
            n *= s
        self.margin = int(margin)
        self.n = n
        self._buf = torch.empty(n + 2 * self.margin, dtype=dtype, device=device)
        if dtype.is_floating_point and dtype.itemsize == 1:
            self._buf.view(torch.uint8).fill_(0x7F)  # a NaN pattern in e4m3fn
        else:
            self._buf.fill_(_poison(dtype))
        self._ref = bits(self._buf[: self.margin].clone())
        self.tensor = self._buf[self.margin: self.margin + n].view(shape)

    def check(self) -> None:
        head = bits(self._buf[: self.margin])
        tail = bits(self._buf[self.margin + self.n:])
        if not torch.equal(head, self._ref):
            raise AssertionError("a kernel wrote before the start of its output (guard region corrupted)")
        if not torch.equal(tail, self._ref):
            raise AssertionError("a kernel wrote past the end of its output (guard region corrupted)")

    def unwritten(self) -> int:
        return int((bits(self.tensor).reshape(-1) == self._ref[0]).sum())
