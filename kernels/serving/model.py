"""A small Qwen3-style decoder (dense or MoE) built on the kit's kernels, which also runs Llama
layers (no per-head q/k norms, tied embeddings: SmolLM2, :mod:`.smollm2`).

Every reduction of a forward pass goes through a kit kernel, all of them given one switch,
``impl="variant"`` or ``impl="invariant"``:

* RMSNorm (``input_layernorm``, the per-head ``q_norm`` / ``k_norm``, the final ``norm``) and the
  fused residual add + RMSNorm (``post_attention_layernorm`` and the next layer's
  ``input_layernorm``): :mod:`batch_invariance_kit.ops.rms_norm`;
* the projections (fused QKV, ``o_proj``, fused gate/up, ``down_proj``, ``lm_head``):
  :func:`batch_invariance_kit.ops.matmul.linear`;
* causal GQA attention over a paged KV cache (prefill, decode and mixed varlen steps):
  :mod:`batch_invariance_kit.ops.attention`;
* the MoE block (router + experts): :func:`batch_invariance_kit.ops.moe.fused_moe`.

What stays plain torch is row-local and has no reduction: the embedding lookup (a gather), RoPE
(``cos``/``sin`` are read from a table computed once for every position, so no transcendental
is evaluated per batch; then elementwise ``*`` and ``+``), SiLU-and-mul of the dense MLP, and the
final ``log_softmax`` in fp32 over the vocabulary (one row at a time; vocab-sized rows).

Weights are random, from a fixed seed, with :func:`batch_invariance_kit.verify.harness.seeded_normal` (the same bits
on every machine), named like Hugging Face's Qwen3 / Qwen3-MoE / Llama checkpoints so that
:meth:`Qwen3Model.save_pretrained` writes a folder (``model.safetensors`` + ``config.json``) that
vLLM / transformers can load as ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` /
``LlamaForCausalLM``; :meth:`Qwen3Model.from_pretrained` reads such a folder, a trained Llama
checkpoint included (``model_type: llama``).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import torch

from ..ops import attention as A
from ..ops import moe as MOE
from ..ops import rms_norm as RN
from ..checks import DTYPES
from ..device import DEVICE
from ..verify.harness import seeded_normal
from ..ops.matmul import linear

__all__ = ["IMPLS", "FAMILIES", "resolve_impl", "Qwen3Config", "StepBatch", "Qwen3Model", "param_names",
           "random_weights", "init_weight", "rope_tables", "apply_rope", "swiglu_mlp", "save_hf_folder",
           "read_hf_folder"]

IMPLS = ("invariant", "variant")


@dataclass
class Qwen3Config:
    """The model's shape, with Hugging Face's key names.  ``num_experts = 0``: dense (SwiGLU MLP);
    ``num_experts > 0``: every layer's MLP is a MoE (Qwen3-MoE, no shared expert)."""

    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 1024
    torch_dtype: str = "float32"
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    norm_topk_prob: bool = True
    seed: int = 0
    #: per-head RMSNorm of q and k (Qwen3); ``False``: Llama layers
    qk_norm: bool = True
    #: the lm_head is the embedding matrix (SmolLM2)
    tie_word_embeddings: bool = False

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.torch_dtype]

    def hf_config(self) -> dict:
        """The ``config.json`` of a Hugging Face checkpoint of this model."""
        if not self.qk_norm and self.is_moe:
            raise ValueError("Llama layers (qk_norm=False) are dense: num_experts must be 0")
        arch, mtype = (("Qwen3MoeForCausalLM", "qwen3_moe") if self.is_moe else ("Qwen3ForCausalLM", "qwen3")) \
            if self.qk_norm else ("LlamaForCausalLM", "llama")
        c = {
            "architectures": [arch],
            "model_type": mtype,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.num_hidden_layers,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": 0.02,
            "use_cache": True,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "torch_dtype": self.torch_dtype,
            "kit_seed": self.seed,
        }
        if self.is_moe:
            c.update({"num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                      "moe_intermediate_size": self.moe_intermediate_size, "norm_topk_prob": self.norm_topk_prob,
                      "decoder_sparse_step": 1, "mlp_only_layers": [], "output_router_logits": False,
                      "router_aux_loss_coef": 0.001})
        return c

    @classmethod
    def from_hf_config(cls, c: dict) -> "Qwen3Config":
        keys = {f for f in cls.__dataclass_fields__}
        kw = {k: v for k, v in c.items() if k in keys}
        if "kit_seed" in c:
            kw["seed"] = c["kit_seed"]
        if "Qwen3MoeForCausalLM" not in c.get("architectures", []):
            kw["num_experts"] = 0
        if c.get("model_type") == "llama":
            kw["qk_norm"] = False
            kw.setdefault("head_dim", c["hidden_size"] // c["num_attention_heads"])
        if "rope_theta" not in c and isinstance(c.get("rope_parameters"), dict):
            kw["rope_theta"] = c["rope_parameters"]["rope_theta"]
        if "torch_dtype" not in c and c.get("dtype") in DTYPES:
            kw["torch_dtype"] = c["dtype"]
        return cls(**kw)


def param_names(cfg: Qwen3Config) -> list:
    """``[(hf_name, shape)]`` of every parameter, in a fixed order."""
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    out = [("model.embed_tokens.weight", (V, H))]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (H,)),
                (p + "self_attn.q_proj.weight", (hq * d, H)),
                (p + "self_attn.k_proj.weight", (hkv * d, H)),
                (p + "self_attn.v_proj.weight", (hkv * d, H)),
                (p + "self_attn.q_norm.weight", (d,)),
                (p + "self_attn.k_norm.weight", (d,)),
                (p + "self_attn.o_proj.weight", (H, hq * d)),
                (p + "post_attention_layernorm.weight", (H,))]
        if not cfg.qk_norm:
            out = [o for o in out if not o[0].endswith(("q_norm.weight", "k_norm.weight"))]
        if cfg.is_moe:
            Im = cfg.moe_intermediate_size
            out.append((p + "mlp.gate.weight", (cfg.num_experts, H)))
            for e in range(cfg.num_experts):
                q = f"{p}mlp.experts.{e}."
                out += [(q + "gate_proj.weight", (Im, H)), (q + "up_proj.weight", (Im, H)),
                        (q + "down_proj.weight", (H, Im))]
        else:
            out += [(p + "mlp.gate_proj.weight", (I, H)), (p + "mlp.up_proj.weight", (I, H)),
                    (p + "mlp.down_proj.weight", (H, I))]
    out += [("model.norm.weight", (H,))] + ([] if cfg.tie_word_embeddings else [("lm_head.weight", (V, H))])
    return out


def _seed_of(seed: int, name: str) -> int:
    """A parameter's own stream: from the model seed and its name (machine-independent)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def init_weight(name: str, shape: tuple, x: torch.Tensor) -> torch.Tensor:
    """A standard-normal draw ``x`` of parameter ``name`` scaled to its distribution: linears
    ``N(0, 1/fan_in)``, embeddings ``N(0, 1)``, norm weights ``1 + 0.1 N(0, 1)`` (so that they
    are not all ones)."""
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * x
    if name != "model.embed_tokens.weight":
        return x * shape[1] ** -0.5
    return x


def random_weights(cfg: Qwen3Config) -> dict:
    """CPU tensors in ``cfg.dtype``, HF names, drawn with :func:`batch_invariance_kit.verify.harness.seeded_normal`
    and scaled by :func:`init_weight`."""
    return {name: init_weight(name, shape, seeded_normal(shape, _seed_of(cfg.seed, name))).to(cfg.dtype)
            for name, shape in param_names(cfg)}


def rope_tables(dim: int, theta: float, max_positions: int, device) -> tuple:
    """RoPE's ``(cos, sin)`` of every position, ``(max_positions, dim)`` fp32 (rotate-half layout:
    the frequencies twice), computed once in float64 and rounded, so a token's values never
    depend on the batch it is part of."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    ang = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=1)
    return ang.cos().to(dtype=torch.float32, device=device), ang.sin().to(dtype=torch.float32, device=device)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half (neox-style) RoPE of ``x`` ``(T, heads, dim)`` at ``positions`` ``(T,)``:
    element-wise fp32 ``x * cos + rotate_half(x) * sin`` from the tables of :func:`rope_tables`,
    rounded to x's dtype."""
    c = cos[positions][:, None, :]
    s = sin[positions][:, None, :]
    xf = x.float()
    h = xf.shape[-1] // 2
    rot = torch.cat([-xf[..., h:], xf[..., :h]], dim=-1)
    return (xf * c + rot * s).to(x.dtype)


def swiglu_mlp(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, *, impl: str = "invariant",
               config=None) -> torch.Tensor:
    """The dense SwiGLU MLP: ``down(silu(gate h) * up h)`` with the kit's matmul (``gate_up``: the
    gate rows, then the up rows); SiLU-and-mul in fp32, element-wise, rounded to h's dtype."""
    gu = linear(h, gate_up, impl=impl, config=config)
    inter = gu.shape[1] // 2
    act = (torch.nn.functional.silu(gu[:, :inter].float()) * gu[:, inter:].float()).to(gu.dtype)
    return linear(act, down, impl=impl, config=config)


def save_hf_folder(folder: str, config: dict, weights: dict) -> dict:
    """A Hugging Face folder: ``config.json`` (``config``) and one ``model.safetensors`` (the
    ``weights``, copied to the CPU); returns ``{"config": path, "weights": path, "format":
    "safetensors"}``."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    cpath = os.path.join(folder, "config.json")
    with open(cpath, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    wpath = os.path.join(folder, "model.safetensors")
    save_file({k: v.detach().to("cpu").contiguous() for k, v in weights.items()}, wpath, metadata={"format": "pt"})
    return {"config": cpath, "weights": wpath, "format": "safetensors"}


def read_hf_folder(folder: str) -> tuple:
    """``(config dict, {name: tensor})`` of a folder with ``config.json`` and one
    ``model.safetensors``."""
    from safetensors.torch import load_file

    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    return config, load_file(os.path.join(folder, "model.safetensors"))


FAMILIES = ("norm", "linear", "attention", "moe")


def resolve_impl(impl) -> dict:
    """``"invariant"`` / ``"variant"`` -> that impl for every kernel family; a dict
    ``{family: impl}`` (families :data:`FAMILIES`; missing ones are ``"invariant"``) -> per family."""
    if isinstance(impl, str):
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS} or a dict, got {impl!r}")
        return {f: impl for f in FAMILIES}
    if not isinstance(impl, dict) or set(impl) - set(FAMILIES) or set(impl.values()) - set(IMPLS):
        raise ValueError(f"impl dict must map some of {FAMILIES} to one of {IMPLS}, got {impl!r}")
    return {f: impl.get(f, "invariant") for f in FAMILIES}


@dataclass
class StepBatch:
    """One forward step of a varlen batch (vLLM's layout).

    ``tokens``, ``positions``, ``slot_mapping``: ``(T,)``, the new tokens of every sequence back
    to back; ``block_table`` ``(S, max_blocks)`` int32, ``seq_lens`` ``(S,)`` int32 (context after
    this step), ``query_start_loc`` ``(S+1,)`` int32; ``logits_indices``: the rows of ``T`` whose
    next-token log-probabilities are wanted."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    logits_indices: torch.Tensor


@dataclass
class _Layer:
    in_norm: torch.Tensor
    qkv: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor | None = None
    down: torch.Tensor | None = None
    router: torch.Tensor | None = None
    experts_gate_up: torch.Tensor | None = None
    experts_down: torch.Tensor | None = None


class Qwen3Model:
    """The decoder.  ``Qwen3Model(cfg)`` draws the weights from ``cfg.seed``;
    ``Qwen3Model.from_pretrained(folder)`` reads a folder written by :meth:`save_pretrained`.
    ``linear_config``: the matmul M/N tiling forced on every projection (a name of
    :data:`batch_invariance_kit.ops.matmul.CONFIGS`; ``None``: the cost model's pick per shape).  The
    tiling decides which program computes an output element, never how, so it changes no bits of
    the invariant kernels; under the Triton interpreter a wider tile means fewer programs."""

    def __init__(self, cfg: Qwen3Config, weights: dict | None = None, device=None, linear_config=None):
        self.cfg = cfg
        self.linear_config = linear_config
        self.device = DEVICE if device is None else torch.device(device)
        self.weights = random_weights(cfg) if weights is None else dict(weights)
        dt, dev = cfg.dtype, self.device

        def g(name):
            return self.weights[name].to(dtype=dt, device=dev).contiguous()

        #: the attention heads this model computes (a tensor-parallel shard holds a slice of them)
        self.q_heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.embed = g("model.embed_tokens.weight")
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            L = _Layer(in_norm=g(p + "input_layernorm.weight"),
                       qkv=torch.cat([g(a + "q_proj.weight"), g(a + "k_proj.weight"), g(a + "v_proj.weight")]),
                       q_norm=g(a + "q_norm.weight") if cfg.qk_norm else None,
                       k_norm=g(a + "k_norm.weight") if cfg.qk_norm else None, o=g(a + "o_proj.weight"),
                       post_norm=g(p + "post_attention_layernorm.weight"))
            if cfg.is_moe:
                E = cfg.num_experts
                L.router = g(p + "mlp.gate.weight")
                L.experts_gate_up = torch.stack([
                    torch.cat([g(f"{p}mlp.experts.{e}.gate_proj.weight"), g(f"{p}mlp.experts.{e}.up_proj.weight")])
                    for e in range(E)]).contiguous()
                L.experts_down = torch.stack([g(f"{p}mlp.experts.{e}.down_proj.weight")
                                              for e in range(E)]).contiguous()
            else:
                L.gate_up = torch.cat([g(p + "mlp.gate_proj.weight"), g(p + "mlp.up_proj.weight")])
                L.down = g(p + "mlp.down_proj.weight")
            self.layers.append(L)
        self.norm = g("model.norm.weight")
        self.lm_head = self.embed if cfg.tie_word_embeddings else g("lm_head.weight")
        self.cos, self.sin = rope_tables(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, dev)

    # ---------------------------------------------------------------------------------- I/O
    def save_pretrained(self, folder: str) -> dict:
        """Write ``config.json`` and ``model.safetensors`` (HF names) to ``folder``; returns
        ``{"config": path, "weights": path, "format": "safetensors"}``."""
        return save_hf_folder(folder, self.cfg.hf_config(), self.weights)

    @classmethod
    def from_pretrained(cls, folder: str, device=None) -> "Qwen3Model":
        config, weights = read_hf_folder(folder)
        return cls(Qwen3Config.from_hf_config(config), weights, device=device)

    # ------------------------------------------------------------------------------ forward
    def new_kv_cache(self, num_blocks: int, block_size: int) -> list:
        """One ``(k_cache, v_cache)`` pair per layer (the block table is shared by all layers)."""
        c = self.cfg
        return [A.new_cache(num_blocks, block_size, self.kv_heads, c.head_dim, dtype=c.dtype,
                            device=self.device) for _ in range(c.num_hidden_layers)]

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, positions, self.cos, self.sin)

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over tensor-parallel ranks of a row-parallel output (``o_proj``, the MLP or MoE
        block): here, one rank holding every weight, the output itself.
        :class:`batch_invariance_kit.serving.tensor_parallel.ShardedQwen3Model` sums its ranks'."""
        return partial

    @torch.no_grad()
    def forward(self, batch: StepBatch, kv_cache: list, *, impl: str = "invariant", return_hidden: bool = False):
        """Run one step: writes the new tokens' keys/values into ``kv_cache`` and returns the
        fp32 log-probabilities ``(len(logits_indices), vocab)`` of the next token.  ``impl``:
        ``"invariant"`` or ``"variant"`` for every kernel, or a dict per kernel family (see
        :func:`resolve_impl`; to find which kernel makes a variant run differ).
        ``return_hidden``: also return the final-norm hidden states of those rows (the input of
        ``lm_head``), as ``(logprobs, hidden)``."""
        im = resolve_impl(impl)
        lc = self.linear_config
        c = self.cfg
        hq, hkv, d, eps = self.q_heads, self.kv_heads, c.head_dim, c.rms_norm_eps
        T = batch.tokens.shape[0]
        x = self.embed[batch.tokens]
        residual = x
        h = RN.rms_norm(x, self.layers[0].in_norm, eps, impl=im["norm"])
        for i, L in enumerate(self.layers):
            qkv = linear(h, L.qkv, impl=im["linear"], config=lc)
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
            if L.q_norm is not None:  # Qwen3's per-head norms (Llama has none)
                q = RN.rms_norm(q.reshape(T * hq, d).contiguous(), L.q_norm, eps, impl=im["norm"]).view(T, hq, d)
                k = RN.rms_norm(k.reshape(T * hkv, d).contiguous(), L.k_norm, eps, impl=im["norm"]).view(T, hkv, d)
            else:
                q, k = q.reshape(T, hq, d), k.reshape(T, hkv, d)
            q = self._rope(q, batch.positions)
            k = self._rope(k, batch.positions)
            v = v.reshape(T, hkv, d).contiguous()
            kc, vc = kv_cache[i]
            A.write_kv(k.contiguous(), v, kc, vc, batch.slot_mapping)
            o = A.attention(q.contiguous(), kc, vc, batch.block_table, batch.seq_lens, batch.query_start_loc,
                            impl=im["attention"])
            o = self.all_reduce(linear(o.reshape(T, hq * d), L.o, impl=im["linear"], config=lc))
            h, residual = RN.fused_add_rms_norm(o, residual, L.post_norm, eps, impl=im["norm"])
            if c.is_moe:
                m = MOE.fused_moe(h, L.router, L.experts_gate_up, L.experts_down, c.num_experts_per_tok,
                                  renormalize=c.norm_topk_prob, impl=im["moe"])
            else:
                m = swiglu_mlp(h, L.gate_up, L.down, impl=im["linear"], config=lc)
            m = self.all_reduce(m)
            nxt = self.layers[i + 1].in_norm if i + 1 < len(self.layers) else self.norm
            h, residual = RN.fused_add_rms_norm(m, residual, nxt, eps, impl=im["norm"])
        h = h[batch.logits_indices].contiguous()
        logits = linear(h, self.lm_head, impl=im["linear"], config=lc)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        return (logprobs, h) if return_hidden else logprobs
