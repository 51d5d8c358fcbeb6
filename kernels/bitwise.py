"""Bits of tensors, shared by every layer of the kit: a tensor's raw bit pattern, bitwise
equality, the distance in units in the last place, and inputs drawn bitwise the same on every
machine.  The kernels (:mod:`.ops`) use them for their self-checks and examples, the proofs
(:mod:`.verify`) for every comparison; :mod:`.verify.harness` re-exports them."""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["bits", "bitwise_equal", "ulp_distance", "seeded_normal"]

_INT_OF = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _INT_OF[getattr(torch, _name)] = torch.int8


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern of a floating tensor as a signed integer tensor (same shape).

    Integer and bool tensors are returned as they are."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"bits: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype in _INT_OF:
        return t.contiguous().view(_INT_OF[t.dtype])
    if t.dtype.is_floating_point or t.is_complex():
        raise TypeError(f"bits: unsupported dtype {t.dtype}")
    return t


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` have the same dtype, shape and bits."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach(), b.detach()
    if a.device != b.device:
        a, b = a.cpu(), b.cpu()
    return bool(torch.equal(bits(a), bits(b)))


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise distance in units in the last place (int64 tensor).

    Floats are mapped to integers ordered like the reals (sign-magnitude to two's
    complement), so that adjacent representable values are 1 apart and
    ``+0.0``/``-0.0`` are 0 apart.  For integer tensors it is ``|a - b|``."""
    if a.dtype != b.dtype:
        raise TypeError(f"ulp_distance: dtypes differ ({a.dtype} vs {b.dtype})")
    if a.shape != b.shape:
        raise ValueError(f"ulp_distance: shapes differ ({tuple(a.shape)} vs {tuple(b.shape)})")
    a = a.detach().cpu()
    b = b.detach().cpu()
    if a.dtype not in _INT_OF:
        return (a.long() - b.long()).abs()
    width = torch.finfo(a.dtype).bits
    ia = bits(a).long()
    ib = bits(b).long()
    if width < 64:
        ia = ia & ((1 << width) - 1)  # unsigned view of the bit pattern
        ib = ib & ((1 << width) - 1)
        sign = 1 << (width - 1)
        mag_mask = sign - 1
        oa = torch.where(ia & sign != 0, -(ia & mag_mask), ia & mag_mask)
        ob = torch.where(ib & sign != 0, -(ib & mag_mask), ib & mag_mask)
    else:  # float64: ordered mapping inside int64 (may saturate for huge distances)
        mag_mask = (1 << 63) - 1
        oa = torch.where(ia < 0, -(ia & mag_mask), ia)
        ob = torch.where(ib < 0, -(ib & mag_mask), ib)
    return (oa - ob).abs()


def seeded_normal(shape, seed: int, *, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Bell-shaped random values that are *bitwise the same on every machine*.

    ``torch.randn`` may differ in the last bits between CPU vector paths, which would make
    a notebook's checked output depend on the machine.  Here each value is
    ``(u1 + u2 + u3 + u4 - 2) * sqrt(3)`` in float64 with ``u`` from numpy's PCG64
    ``random()`` (bit-exact everywhere; only IEEE additions and one multiply follow): mean
    0, standard deviation 1, full precision; then rounded to ``dtype`` (RNE)."""
    if isinstance(shape, int):
        shape = (shape,)
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"shape must be non-negative, got {shape}")
    rng = np.random.Generator(np.random.PCG64(int(seed)))
    u = rng.random(size=(4,) + shape)
    x = (((u[0] + u[1]) + (u[2] + u[3])) - 2.0) * np.float64(1.7320508075688772)
    return torch.from_numpy(x).to(dtype=dtype, device=device if device is not None else "cpu")
