"""Launch a compiled Triton kernel again without ``JITFunction.run``'s per-call work.

``kernel[grid](*args, **kw)`` spends most of an eager launch's host time before the launch
itself: it binds and specialises every argument, turns the specialisation and the options into
a cache key (``str(options)`` on every call), looks the compiled kernel up, checks the globals it
read, builds launch metadata for hooks, and only then calls the compiled kernel's launcher.  At a
decode step run outside CUDA graphs (vLLM replays graphs up to 512 tokens; a batch of 1,000
sequences runs eagerly) a Qwen3-8B-shaped layer makes about ten such launches, 36 layers a step.

:class:`DirectLaunch` wraps one ``@triton.jit`` function.  Its first launch for an argument
*signature* goes through Triton (which compiles or finds the kernel); it remembers the compiled
kernel under that signature and calls the kernel's launcher directly from then on, with the same
arguments, in the order Triton's own launcher receives them (every parameter, constexprs
included).  The signature is a superset of what Triton specialises on:

* a tensor: its dtype and whether its address is a multiple of 16 bytes;
* an int: whether it is 1, a multiple of 16, and which of int32 / int64 / uint64 holds it;
* a float: its type only (Triton passes it as fp32 and never specialises on its value);
* a host tensor descriptor: its base's dtype and alignment, its block shape and its padding
  (Triton's own key for one is its base's dtype and its block shape: the shape and strides reach
  the kernel as launch arguments, never as specialisations);
* a bool: its value, tagged as a bool (so that ``False`` and an int of class 0 differ);
* ``None``, every constexpr and launch option: its type and value (``True``, ``1`` and ``1.0``
  are different constexprs to Triton);
* the current device, and Triton's ``debug`` and ``instrumentation_mode`` knobs (both enter its
  compile options).

So two calls with the same signature get the same kernel from Triton too, and the direct launch
runs the kernel Triton would run, on the current stream.  It leaves out Triton's per-launch check
that the module globals a kernel read have not changed since it was compiled (check mode runs it).
It steps aside (the call goes through Triton) under the interpreter, for a Triton other than the
one whose launch path it follows (:data:`SUPPORTED_TRITON`), while launch hooks or pre-run hooks
are set, for a grid that is not a tuple, for an argument type it does not know, and when
``KIT_DIRECT_LAUNCH=0``.  ``KIT_DIRECT_LAUNCH=check`` runs Triton's binder and cache lookup beside
every direct launch and raises if either disagrees (and compares every remembered descriptor
expansion with a fresh one, byte for byte): run the GPU tests in that mode to verify it.

The launcher itself is called without its Python frames where Triton 3.6's CUDA launcher allows
(:class:`_RawLaunch`: a kernel without scratch buffers): the C launch function gets the fixed
arguments the launcher would add, and each host tensor descriptor's expansion (a ``CUtensorMap``
built by the driver, plus its shape and strides) is remembered per base address, shape, strides
and padding instead of being rebuilt on every call; for a linear layer's weight it is built once.
"""
from __future__ import annotations

import ctypes
import os
import types

import torch
import triton

from ..device import INTERPRET

try:  # the knobs and the driver of the Triton releases this module follows
    from triton import knobs as _knobs
    from triton.runtime import driver as _driver
    from triton.tools.tensor_descriptor import TensorDescriptor as _HostDescriptor
except ImportError:  # pragma: no cover - an older Triton: every launch goes through Triton
    _knobs = _driver = _HostDescriptor = None
try:  # Triton 3.6's CUDA launcher: its class, how it expands a host descriptor, its fixed arguments
    from triton.backends.nvidia import driver as _nv
    _CudaLauncher, _expand_descriptor, _wrap_descriptors = (_nv.CudaLauncher, _nv.make_tensordesc_arg,
                                                            _nv.wrap_handle_tensordesc)
    if getattr(_nv, "_BASE_ARGS_FORMAT", None) != "iiiKKppOOOOOO":  # not the launch convention modelled here
        _CudaLauncher = None
except (ImportError, AttributeError):  # pragma: no cover - no CUDA backend: the launcher is called as it is
    _CudaLauncher = _expand_descriptor = _wrap_descriptors = None

__all__ = ["DirectLaunch", "SUPPORTED_TRITON", "mode", "set_mode", "stats"]

#: The Triton releases whose launch path (``JITFunction.run`` -> ``CompiledKernel.run``) this
#: module follows; under any other the wrapped kernels launch through Triton.
SUPPORTED_TRITON = ("3.6",)

_MODES = ("on", "off", "check")
#: Signatures remembered per kernel; past it the memo starts over (a process that sees this many
#: distinct launch signatures of one kernel is not one a memo helps).
MAX_SIGNATURES = 4096

_I32 = (-(2 ** 31), 2 ** 31 - 1)
_U64 = 2 ** 63


def _env_mode() -> str:
    m = os.environ.get("KIT_DIRECT_LAUNCH", "on").strip().lower() or "on"
    m = {"1": "on", "0": "off"}.get(m, m)
    if m not in _MODES:
        raise ValueError(f"KIT_DIRECT_LAUNCH must be one of on, off, check, 1, 0; got {m!r}")
    return m


_mode = _env_mode()
_stats = {"direct": 0, "through_triton": 0, "checked": 0}


def mode() -> str:
    """``"on"``, ``"off"`` or ``"check"`` (from ``KIT_DIRECT_LAUNCH``, or :func:`set_mode`)."""
    return _mode


def set_mode(m: str) -> str:
    """Set the mode for this process; returns the previous one."""
    global _mode
    if m not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {m!r}")
    prev, _mode = _mode, m
    return prev


def stats() -> dict:
    """Counts of launches made directly, through Triton, and checked against Triton's lookup."""
    return dict(_stats)


def _triton_supported() -> bool:
    if _knobs is None:
        return False
    return any(triton.__version__ == v or triton.__version__.startswith(v + ".") for v in SUPPORTED_TRITON)


#: a compiled launch on a CUDA device (compiling offline for sm_90 on a machine without one, every
#: launch goes through Triton: see :mod:`batch_invariance_kit.verify.sm90`)
_SUPPORTED = _triton_supported() and not INTERPRET and torch.cuda.is_available()


class _Unsupported(Exception):
    """An argument whose specialisation this module does not model."""


def _int_class(v: int) -> int:
    return ((v == 1) | ((v & 15) == 0) << 1 | (_I32[0] <= v <= _I32[1]) << 2 | (v >= _U64) << 3)


def _spec(a):
    """The part of the signature that argument ``a`` contributes (see the module docstring)."""
    t = type(a)
    if t is torch.Tensor or isinstance(a, torch.Tensor):
        return (a.dtype, (a.data_ptr() & 15) == 0)
    if t is int:
        return _int_class(a)
    if t is float:
        return float
    if t is bool:
        return (bool, a)
    if a is None:
        return None
    if t is _HostDescriptor:
        return ("desc", a.base.dtype, (a.base.data_ptr() & 15) == 0, tuple(a.block_shape),
                getattr(a, "padding", None))
    raise _Unsupported(t.__name__)


class _Layout:
    """How a call's ``(args, kw)`` map onto the kernel's parameters, per (positional count,
    keyword names): the parameters after the positional ones (each filled from ``kw`` or its
    default), which positional arguments and keywords are constexprs, and whether any keyword is a
    runtime argument (whose value the signature must not hold)."""

    def __init__(self, fn, n_args: int, kw_names: tuple):
        params = list(fn.params)
        if n_args > len(params):
            raise _Unsupported("too many positional arguments")
        by_name = {p.name: p for p in params}
        self.tail = []
        for p in params[n_args:]:
            if p.name in kw_names:
                self.tail.append((p.name, None))
            elif p.has_default:
                self.tail.append((None, p.default))
            else:
                raise _Unsupported(f"missing argument {p.name}")
        self.pos_const = tuple(i for i, p in enumerate(params[:n_args]) if p.is_constexpr)
        # per keyword: True = its value enters the signature (a constexpr or a launch option)
        self.kw_const = tuple(k not in by_name or by_name[k].is_constexpr for k in kw_names)
        self.kw_runtime = not all(self.kw_const)

    def signature(self, args, kw) -> tuple:
        """What the call contributes to the signature beyond its layout and device."""
        if self.pos_const:
            pos = tuple([(type(a), a) if i in self.pos_const else _spec(a) for i, a in enumerate(args)])
        else:
            pos = tuple([(a.dtype, (a.data_ptr() & 15) == 0) if type(a) is torch.Tensor else _spec(a)
                         for a in args])
        vals = kw.values()
        if self.kw_runtime:
            kws = tuple([(type(v), v) if c else _spec(v) for v, c in zip(vals, self.kw_const)])
        else:
            kws = (tuple(vals), tuple(map(type, vals)))
        return pos, kws

    def tail_values(self, kw) -> tuple:
        return tuple([kw[n] if n is not None else d for n, d in self.tail])


class DirectLaunch:
    """``DirectLaunch(fn)(grid, *args, **kw)`` launches ``fn[grid](*args, **kw)`` (see the module
    docstring).  ``grid`` is a tuple of one to three ints."""

    def __init__(self, fn):
        self.fn = fn
        self._layouts: dict = {}
        #: signature -> (compiled kernel, the parameters after the positional ones, or None when
        #: a runtime keyword makes them differ per call)
        self._kernels: dict = {}

    def __repr__(self):
        return f"DirectLaunch({getattr(self.fn, '__name__', self.fn)!r})"

    def __call__(self, grid, *args, **kw):
        if not _SUPPORTED or _mode == "off" or type(grid) is not tuple or _hooks_set(self.fn):
            return self._through_triton(grid, args, kw)
        lk = (len(args), tuple(kw))
        try:
            lay = self._layouts.get(lk)
            if lay is None:
                lay = self._layouts[lk] = _Layout(self.fn, len(args), lk[1])
            device = _current_device()
            rt = _knobs.runtime
            key = (lk, device, rt.debug, _knobs.compilation.instrumentation_mode, *lay.signature(args, kw))
            entry = self._kernels.get(key)
        except (_Unsupported, TypeError):  # an argument this module does not model, an unhashable constexpr
            return self._through_triton(grid, args, kw)
        if entry is None:
            kernel = self._through_triton(grid, args, kw)
            if getattr(kernel, "packed_metadata", None) is None:  # not a compiled kernel (a stand-in run)
                return kernel
            if len(self._kernels) >= MAX_SIGNATURES:
                self._kernels.clear()
            self._kernels[key] = (kernel, None if lay.kw_runtime else lay.tail_values(kw), _RawLaunch.of(kernel))
            return kernel
        kernel, tail, raw = entry
        full = args + (lay.tail_values(kw) if tail is None else tail)
        stream = _driver.active.get_current_stream(device)
        n = len(grid)
        g1, g2 = (grid[1] if n > 1 else 1), (grid[2] if n > 2 else 1)
        if raw is None:  # the compiled kernel's launcher, called as JITFunction.run calls it (no hooks)
            kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *full)
        else:
            raw(grid[0], g1, g2, stream, full)
        if _mode == "check":
            self._check(kernel, args, kw, full, device, raw, (grid[0], g1, g2, stream))
        _stats["direct"] += 1
        return kernel

    def _through_triton(self, grid, args, kw):
        _stats["through_triton"] += 1
        return self.fn[grid](*args, **kw)

    def _check(self, kernel, args, kw, full, device, raw, launch):
        """Triton's own binder and cache lookup for this call: the same kernel, the same arguments
        (and, for a launcher called without its Python frames, the same launch arguments)."""
        from triton.runtime.jit import compute_cache_key
        kw = dict(kw)
        kw["debug"] = kw.get("debug", self.fn.debug) or _knobs.runtime.debug
        kw["instrumentation_mode"] = _knobs.compilation.instrumentation_mode
        kernel_cache, key_cache, _, _, binder = self.fn.device_caches[device]
        bound, specialization, options = binder(*args, **kw)
        theirs = kernel_cache.get(compute_cache_key(key_cache, specialization, options))
        if theirs is not kernel:
            raise AssertionError(f"{self!r}: the remembered kernel is not the one Triton looks up for this call")
        for (name, _), (val, globals_dict) in getattr(self.fn, "used_global_vals", {}).items():
            if globals_dict.get(name, _MISSING) != val:
                raise AssertionError(f"{self!r}: global {name} changed since the kernel was compiled")
        values = list(bound.values())
        if len(values) != len(full) or not all(_same(a, b) for a, b in zip(values, full)):
            raise AssertionError(f"{self!r}: the direct launch's arguments differ from Triton's bound arguments")
        if raw is not None:  # launch: the padded grid and the stream of this call
            raw.check(kernel, *launch, full)
        _stats["checked"] += 1


_MISSING = object()


def _same(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return type(a) is type(b) and a == b


def _hook_active(h) -> bool:
    """A launch hook that would run: Triton 3.6 keeps each as a chain (``calls``), empty unless a
    profiler or a user added one."""
    return h is not None and bool(getattr(h, "calls", True))


def _hooks_set(fn) -> bool:
    rt = _knobs.runtime
    return (_hook_active(rt.launch_enter_hook) or _hook_active(rt.launch_exit_hook)
            or bool(getattr(fn, "pre_run_hooks", None)))


def _current_device() -> int:
    return _driver.active.get_current_device()


#: Host descriptors whose expansion one launcher keeps; past it the memo starts over
MAX_DESCRIPTORS = 256
#: Triton 3.6's launcher: grid (3), stream, function, cooperative grid, PDL, two scratch
#: buffers, packed metadata, launch metadata, enter and exit hooks; then the parameters
_BASE_ARGS = 13


class _RawLaunch:
    """A compiled kernel's launch as Triton 3.6's ``CudaLauncher.__call__`` makes it, for a kernel
    that needs no scratch buffers, without that method's Python frames: the C launch function
    called with the launcher's fixed arguments, and each host tensor descriptor parameter
    expanded into what the kernel receives (a ``CUtensorMap`` and the descriptor's shape and
    strides) once per (base address, shape, strides, padding), instead of on every call.

    A ``CUtensorMap`` is a function of exactly those (and of the kernel's block shape, swizzle
    and element type, fixed per compiled kernel), so a remembered expansion is the one Triton
    would build; it holds no tensor (a descriptor the compiler did not lower to TMA expands to
    its base tensor, and is expanded on every call).  :meth:`check` compares both, byte for byte.
    """

    __slots__ = ("c_launch", "head", "desc", "memo")

    def __init__(self, c_launch, head, desc):
        self.c_launch = c_launch
        self.head = head  # the launch arguments after the grid and stream
        self.desc = desc  # ((parameter index, compiler metadata), ...) in parameter order
        self.memo = [{} for _ in desc]

    @classmethod
    def of(cls, kernel):
        """The raw launch of ``kernel``, or None where its launcher is not one this class models
        (another Triton, a launcher with scratch buffers, a stand-in kernel)."""
        run = getattr(kernel, "run", None)
        if _CudaLauncher is None or type(run) is not _CudaLauncher or "__call__" in vars(run):
            return None
        if run.global_scratch_size or run.profile_scratch_size:
            return None
        launch = run.launch
        code = getattr(launch, "__code__", None)
        if code is None:  # the C function itself: no descriptor parameters
            if not _is_c_function(launch):
                return None
            c_launch, desc = launch, ()
        elif code is not _WRAPPER_CODE:  # not Triton's descriptor-expanding wrapper
            return None
        else:  # Triton's descriptor-expanding wrapper around the C function
            cells = dict(zip(code.co_freevars, (c.cell_contents for c in launch.__closure__ or ())))
            c_launch, idx, meta = cells.get("launcher"), cells.get("tensordesc_indices"), cells.get("tensordesc_meta")
            if c_launch is None or idx is None or meta is None or len(meta) != len(idx):
                return None
            desc = tuple(zip(sorted(idx), meta))
        head = (kernel.function, run.launch_cooperative_grid, run.launch_pdl, None, None, kernel.packed_metadata,
                None, None, None)
        return cls(c_launch, head, desc)

    def _expanded(self, j, d):
        i, meta = self.desc[j]
        if meta is None:  # the compiler kept the descriptor in memory: its expansion holds the tensor
            return _expand_descriptor(d, meta)
        key = (d.base.data_ptr(), tuple(d.shape), tuple(d.strides), d.padding)
        memo = self.memo[j]
        got = memo.get(key)
        if got is None:
            if len(memo) >= MAX_DESCRIPTORS:
                memo.clear()
            got = memo[key] = _expand_descriptor(d, meta)
        return got

    def args(self, g0, g1, g2, stream, full) -> list:
        """What the C launch function receives for this launch."""
        args = [g0, g1, g2, stream, *self.head]
        at = 0
        for j, (i, _) in enumerate(self.desc):
            args += full[at:i]
            args += self._expanded(j, full[i])
            at = i + 1
        args += full[at:]
        return args

    def __call__(self, g0, g1, g2, stream, full):
        if not self.desc:
            return self.c_launch(g0, g1, g2, stream, *self.head, *full)
        return self.c_launch(*self.args(g0, g1, g2, stream, full))

    def check(self, kernel, g0, g1, g2, stream, full):
        """The arguments of this launch equal those Triton's launcher would pass to the C function
        (its own descriptor wrapper, recording instead of launching): the same order, every
        remembered descriptor expansion equal to a fresh one (a tensor map byte for byte)."""
        run = kernel.run
        base = (g0, g1, g2, stream, kernel.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                kernel.packed_metadata, None, None, None)  # CudaLauncher.__call__'s, without scratch or hooks
        seen = []
        mine = self.args(g0, g1, g2, stream, full)
        if self.desc:
            meta = [m for _, m in self.desc]
            _wrap_descriptors(lambda *a: seen.extend(a), kernel.src.signature, meta)(*base, *full)
        else:
            seen = [*base, *full]
        if len(mine) != len(seen) or not all(_same_arg(a, b) for a, b in zip(mine, seen)):
            raise AssertionError("the raw launch's arguments differ from those Triton's launcher passes")


def _same_arg(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if type(a).__name__ == "PyCUtensorMap":
        return _map_bytes(a) == _map_bytes(b)
    if isinstance(a, torch.Tensor):
        return a is b
    return a is b or a == b


def _is_c_function(f) -> bool:
    return isinstance(f, types.BuiltinFunctionType)


#: the code of Triton's descriptor-expanding launcher wrapper (what a launcher's ``launch`` runs
#: for a kernel with descriptor parameters)
_WRAPPER_CODE = (getattr(_wrap_descriptors(print, {0: "tensordesc<fp16[16]>"}, None), "__code__", None)
                 if _wrap_descriptors is not None else None)


def _map_bytes(m) -> bytes:
    """The 128 bytes of a ``CUtensorMap`` Python object (Triton 3.6's object: a header, then the
    map 128-byte aligned, 256 bytes in all)."""
    size = type(m).__basicsize__
    if size != 256:
        raise AssertionError(f"unexpected tensor map object {type(m).__name__} of {size} bytes")
    return ctypes.string_at(id(m) + size - 128, 128)
