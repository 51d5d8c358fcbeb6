"""The package's layers: the kernels (``ops``) stand on the leaf modules (device, checks, bitwise,
emulator) only; the proofs, benchmarks and serving code stand on the kernels, never the reverse."""
import subprocess
import sys

LEAVES = ["batch_invariance_kit", "batch_invariance_kit.bitwise", "batch_invariance_kit.checks",
          "batch_invariance_kit.device", "batch_invariance_kit.emulator"]

_PROBE = """
import importlib, pkgutil, sys
import batch_invariance_kit.ops as ops
for m in pkgutil.walk_packages(ops.__path__, "batch_invariance_kit.ops."):
    importlib.import_module(m.name)
print("\\n".join(sorted(k for k in sys.modules
                        if k.startswith("batch_invariance_kit") and not k.startswith("batch_invariance_kit.ops"))))
"""


def test_every_ops_module_imports_nothing_above_the_kernels():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True).stdout
    loaded = out.split()
    assert loaded, "the probe listed no module of the kit"
    above = [m for m in loaded if m not in LEAVES]
    assert not above, f"importing batch_invariance_kit.ops loads modules above the kernels: {above}"
