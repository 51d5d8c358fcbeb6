"""Input validation shared by every op of the kit: clear errors that name the argument."""
from __future__ import annotations

from typing import Collection

import torch

from . import device as _device

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: The one table of dtype names: result files, command lines and configs spell dtypes this way.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling of :data:`DTYPES` and of every result file)."""
    return str(dtype).replace("torch.", "")


def tensor(name: str, t, *, dtypes: Collection[torch.dtype] | None = FLOAT_DTYPES, dim: int | None = None,
           device: torch.device | None = None, contiguous: bool = True, nonempty: bool = True) -> torch.Tensor:
    """Check one tensor argument; raise TypeError/ValueError naming ``name``.  Each test reads
    one attribute on the common path (every op calls this on every call)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(dtype_name(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {dtype_name(t.dtype)}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if device is not None and t.device.type != torch.device(device).type:
        raise ValueError(f"{name} must be on {torch.device(device).type}, got {t.device}")
    if nonempty and t.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {t.stride()} for shape {tuple(t.shape)})")
    return t


def kernel_device(name: str, t: torch.Tensor) -> None:
    """The kit's Triton kernels run on :data:`batch_invariance_kit.device.DEVICE` (compiled on a
    GPU, interpreted on a CPU): a tensor anywhere else is a ValueError naming ``name``."""
    if not (t.is_cuda if _device.DEVICE.type == "cuda" else t.is_cpu):
        where = "under the Triton interpreter" if _device.INTERPRET else "for the compiled Triton kernels"
        raise ValueError(f"{name} must be on {_device.DEVICE.type} {where}, got {t.device}")


def shares_memory(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether two non-empty tensors on one device live in the same storage."""
    if x.numel() == 0 or y.numel() == 0 or x.device != y.device:
        return False
    return x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()


def output(name: str, t, shape, dtype: torch.dtype, like: torch.Tensor, *, like_name: str = "x",
           contiguous: bool = True, inputs=()) -> torch.Tensor:
    """An op's output argument: ``None`` gives a fresh tensor of ``shape`` and ``dtype`` on
    ``like``'s device; a tensor must have that dtype, shape and device (and be contiguous when
    ``contiguous``) and share no memory with any ``(name, tensor)`` of ``inputs``."""
    if t is None:
        if like.shape == shape and like.is_contiguous():  # the cheapest allocations torch has
            return torch.empty_like(like) if dtype == like.dtype else torch.empty_like(like, dtype=dtype)
        return torch.empty(shape, dtype=dtype, device=like.device)
    tensor(name, t, dtypes=(dtype,), contiguous=contiguous, nonempty=False)
    same_device(name, t, like_name, like)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    for other, x in inputs:
        if x is not None and shares_memory(t, x):
            raise ValueError(f"{name} must not share memory with {other}")
    return t


def same_dtype(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} dtype {dtype_name(t.dtype)} must match {ref_name} dtype {dtype_name(ref.dtype)}")


def same_device(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def positive_float(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v != v:
        raise ValueError(f"{name} must be a positive number, got {v!r}")
    return float(v)


def positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


def norm_operands(x: torch.Tensor, weight, residual=None) -> None:
    """The operands of a normalization beside ``x`` (already checked): ``weight`` of shape
    ``(hidden,)`` and an optional ``residual`` shaped like ``x``, same dtype and device."""
    hidden = x.shape[-1]
    tensor("weight", weight, dim=1)
    same_device("weight", weight, "x", x)
    same_dtype("weight", weight, "x", x)
    if weight.shape[0] != hidden:
        raise ValueError(f"weight must have shape ({hidden},) to match x's hidden size, got {tuple(weight.shape)}")
    if residual is not None:
        tensor("residual", residual, dim=x.dim())
        same_device("residual", residual, "x", x)
        same_dtype("residual", residual, "x", x)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
