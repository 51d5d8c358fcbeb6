"""Host tensor descriptors for the kit's TMA launches (:func:`descriptor`), built without
Triton's per-call re-validation.

``TensorDescriptor.__post_init__`` asserts what a Hopper bulk tensor copy needs of its operand: a
16-byte aligned base and outer strides, a unit inner stride, positive sizes, a power-of-two box.
The kit's launchers decide whether an operand may go through TMA by checking exactly those
properties first (:func:`.matmul._tma_rows`, :func:`.attention.launcher.step_descriptors`) and
fall back to pointer loads otherwise, and their boxes are powers of two by construction, so the
assertions can never fire there; repeating them costs a few microseconds of host time per
descriptor, paid on every eager launch.  :func:`descriptor` builds the same object (the same
fields, the same defaults) without them.  Where the installed Triton's descriptor has a field
this module does not know how to fill, it calls the constructor.
"""
from __future__ import annotations

import dataclasses

from triton.tools.tensor_descriptor import TensorDescriptor

__all__ = ["descriptor"]

_GIVEN = ("base", "shape", "strides", "block_shape")
_FIELDS = {f.name: f.default for f in dataclasses.fields(TensorDescriptor)}
#: the defaults of the fields the kit leaves at their defaults (padding, ...)
_DEFAULTS = {k: v for k, v in _FIELDS.items() if k not in _GIVEN}
#: every field is one the kit gives or one with a plain default
_DIRECT = set(_GIVEN) <= set(_FIELDS) and all(v is not dataclasses.MISSING for v in _DEFAULTS.values())


def descriptor(base, shape, strides, block_shape) -> TensorDescriptor:
    """``TensorDescriptor(base, shape, strides, block_shape)`` for an operand that its launcher
    has checked (see the module docstring), without the constructor's assertions."""
    if not _DIRECT:
        return TensorDescriptor(base, shape, strides, block_shape)
    d = object.__new__(TensorDescriptor)
    d.__dict__.update(_DEFAULTS)
    d.base, d.shape, d.strides, d.block_shape = base, shape, strides, block_shape
    return d
