"""A DeepSeek-V3-style decoder on the kit's kernels: Multi-head Latent Attention over a paged
latent cache, and MoE layers with DeepSeek routing and shared experts.  It is served by the same
engine as :class:`~.model.Qwen3Model` (:mod:`.engine`, :mod:`.rl`): the same step layout
(:class:`~.model.StepBatch`), ``new_kv_cache`` and ``forward``.

One layer, with Hugging Face's ``DeepseekV3`` parameter names:

* the input RMSNorm; one projection of the hidden state to the queries and the compressed KV:
  ``q_proj`` (or the query LoRA ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``) fused with
  ``kv_a_proj_with_mqa`` (the latent and the rope key, shared by every head);
* the latent through ``kv_a_layernorm``; RoPE on the rope parts of the queries and the key
  (DeepSeek's interleaved pairs, laid out as rotate-half: :func:`apply_rope_interleaved`); the
  latent and the rope key stored in the layer's paged latent cache
  (:func:`batch_invariance_kit.ops.mla.write_latent`);
* :func:`batch_invariance_kit.ops.mla.mla`: ``W_kc`` absorbed into the queries, attention over the
  latent, ``W_vc`` (``W_kc`` and ``W_vc`` are the two halves of ``kv_b_proj``), then ``o_proj``;
* the fused residual add + RMSNorm; the first ``first_k_dense_replace`` layers a SwiGLU MLP
  (:func:`~.model.swiglu_mlp`), the others :func:`batch_invariance_kit.ops.routing.deepseek_moe`
  (sigmoid scores plus the correction bias, group-limited top-k, renormalised and scaled, the
  shared experts added after the routed ones).

``impl`` picks the kernels per family as in :func:`~.model.resolve_impl` (``norm``, ``linear``,
``attention``, ``moe``); the ``attention`` family also takes ``"two_forms"``: multi-token steps
expanded to per-head keys and values, one-token steps absorbed (the engines' habit, the negative
control of prefill == decode).

Weights are random from a fixed seed (:func:`batch_invariance_kit.verify.harness.seeded_normal`,
the same bits on every machine) or read from a Hugging Face folder
(:meth:`DeepSeekModel.from_pretrained`); :meth:`DeepSeekModel.save_pretrained` writes a folder
that transformers and vLLM load as ``DeepseekV3ForCausalLM``.  Not covered: YaRN rope scaling
(DeepSeek-V3's long-context setting), fp8 weights, multi-token prediction layers.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

import torch

from .. import checks
from ..checks import DTYPES
from ..device import DEVICE
from ..ops import mla as M
from ..ops import rms_norm as RN
from ..ops import routing as R
from ..ops.matmul import linear
from ..verify.harness import seeded_normal
from .model import (IMPLS, StepBatch, _seed_of, apply_rope, init_weight, read_hf_folder, resolve_impl,
                    rope_tables, save_hf_folder, swiglu_mlp)

__all__ = ["DeepSeekConfig", "DeepSeekModel", "param_names", "random_weights", "resolve_deepseek_impl",
           "apply_rope_interleaved"]

#: the attention family's impls: the MLA kernels' (:data:`batch_invariance_kit.ops.mla.IMPLS`)
ATTENTION_IMPLS = IMPLS + ("two_forms",)


@dataclass(frozen=True)
class DeepSeekConfig:
    """The model's shape, with Hugging Face's ``DeepseekV3Config`` key names.  The defaults are
    DeepSeek-V2-Lite's shape (no query LoRA, latent 512, rope 64, 64 routed experts) with
    DeepSeek-V3's routing (8 groups, 4 kept, sigmoid scores with a correction bias)."""

    vocab_size: int = 102400
    hidden_size: int = 2048
    intermediate_size: int = 10944
    moe_intermediate_size: int = 1408
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    n_routed_experts: int = 64
    n_shared_experts: int = 2
    num_experts_per_tok: int = 6
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    torch_dtype: str = "bfloat16"
    seed: int = 0

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.torch_dtype]

    def mla_shape(self) -> M.MLAShape:
        """The attention's head layout, checked (errors name the field)."""
        return M.MLAShape(self.num_attention_heads, self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim,
                          self.v_head_dim)

    def routing(self) -> R.RoutingConfig:
        """The routing hyper-parameters, checked (errors name the field)."""
        return R.RoutingConfig(self.n_routed_experts, self.n_group, self.topk_group, self.num_experts_per_tok,
                               self.routed_scaling_factor, self.norm_topk_prob)

    def check(self) -> None:
        """Every field a model of this shape needs, checked; a bad one raises a ``ValueError``
        naming it (the MLA and routing shapes are checked again by their kernels' own classes)."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                     "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group",
                     "max_position_embeddings"):
            checks.positive_int(name, getattr(self, name))
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (rotary pairs), got {self.qk_rope_head_dim}")
        if self.n_routed_experts % self.n_group or self.n_routed_experts // self.n_group < 2:
            raise ValueError(f"n_group={self.n_group} must divide n_routed_experts={self.n_routed_experts} into groups "
                             f"of at least 2 experts")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group={self.topk_group} must be <= n_group={self.n_group}")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} is more than the experts of the "
                             f"topk_group={self.topk_group} kept groups")
        if self.q_lora_rank is not None:
            checks.positive_int("q_lora_rank", self.q_lora_rank)
        k = self.first_k_dense_replace
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= self.num_hidden_layers:
            raise ValueError(f"first_k_dense_replace must be an int in 0..num_hidden_layers="
                             f"{self.num_hidden_layers}, got {self.first_k_dense_replace!r}")
        if self.torch_dtype not in DTYPES:
            raise ValueError(f"torch_dtype must be one of {sorted(DTYPES)}, got {self.torch_dtype!r}")
        self.mla_shape()
        self.routing()

    def hf_config(self) -> dict:
        """The ``config.json`` of a Hugging Face checkpoint of this model (``DeepseekV3Config``)."""
        c = {k: v for k, v in asdict(self).items() if k != "seed"}
        c.update({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                  "num_key_value_heads": self.num_attention_heads, "head_dim": self.qk_rope_head_dim,
                  "hidden_act": "silu", "rope_scaling": None, "tie_word_embeddings": False, "bos_token_id": 0,
                  "eos_token_id": 1, "kit_seed": self.seed})
        return c

    @classmethod
    def from_hf_config(cls, c: dict) -> "DeepSeekConfig":
        """The config of a ``DeepseekV3`` checkpoint's ``config.json`` (the keys it does not use
        are ignored; what the model cannot run is refused)."""
        if c.get("model_type") != "deepseek_v3":
            raise ValueError(f"model_type must be 'deepseek_v3' (sigmoid routing with a correction bias), got "
                             f"{c.get('model_type')!r}")
        rp = c.get("rope_parameters") if isinstance(c.get("rope_parameters"), dict) else {}
        scaling = c.get("rope_scaling") or ({} if rp.get("rope_type", "default") == "default" else rp)
        if scaling:
            raise ValueError(f"rope_scaling {scaling!r} is not supported (the kit's model runs plain RoPE)")
        keys = {f.name for f in fields(cls)}
        kw = {k: v for k, v in c.items() if k in keys}
        if "kit_seed" in c:
            kw["seed"] = c["kit_seed"]
        if "rope_theta" not in c and "rope_theta" in rp:
            kw["rope_theta"] = rp["rope_theta"]
        if "torch_dtype" not in c and c.get("dtype") in DTYPES:
            kw["torch_dtype"] = c["dtype"]
        return cls(**kw)


def param_names(cfg: DeepSeekConfig) -> list:
    """``[(hf_name, shape)]`` of every parameter, in a fixed order."""
    H, V, heads = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    out = [("model.embed_tokens.weight", (V, H))]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out.append((p + "input_layernorm.weight", (H,)))
        if cfg.q_lora_rank is None:
            out.append((a + "q_proj.weight", (heads * qk, H)))
        else:
            out += [(a + "q_a_proj.weight", (cfg.q_lora_rank, H)), (a + "q_a_layernorm.weight", (cfg.q_lora_rank,)),
                    (a + "q_b_proj.weight", (heads * qk, cfg.q_lora_rank))]
        out += [(a + "kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H)),
                (a + "kv_a_layernorm.weight", (cfg.kv_lora_rank,)),
                (a + "kv_b_proj.weight", (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)),
                (a + "o_proj.weight", (H, heads * cfg.v_head_dim)),
                (p + "post_attention_layernorm.weight", (H,))]
        if i < cfg.first_k_dense_replace:
            I = cfg.intermediate_size
            out += [(p + "mlp.gate_proj.weight", (I, H)), (p + "mlp.up_proj.weight", (I, H)),
                    (p + "mlp.down_proj.weight", (H, I))]
            continue
        Im, Is = cfg.moe_intermediate_size, cfg.moe_intermediate_size * cfg.n_shared_experts
        out += [(p + "mlp.gate.weight", (cfg.n_routed_experts, H)),
                (p + "mlp.gate.e_score_correction_bias", (cfg.n_routed_experts,))]
        for e in range(cfg.n_routed_experts):
            q = f"{p}mlp.experts.{e}."
            out += [(q + "gate_proj.weight", (Im, H)), (q + "up_proj.weight", (Im, H)),
                    (q + "down_proj.weight", (H, Im))]
        s = p + "mlp.shared_experts."
        out += [(s + "gate_proj.weight", (Is, H)), (s + "up_proj.weight", (Is, H)), (s + "down_proj.weight", (H, Is))]
    return out + [("model.norm.weight", (H,)), ("lm_head.weight", (V, H))]


def _is_bias(name: str) -> bool:
    return name.endswith("e_score_correction_bias")


def random_weights(cfg: DeepSeekConfig) -> dict:
    """CPU tensors, HF names, drawn with :func:`batch_invariance_kit.verify.harness.seeded_normal`
    from ``cfg.seed`` and each name (:func:`~.model.init_weight`'s scales); the correction bias
    ``0.1 N(0, 1)`` in fp32 (large enough to change which experts win), the rest in ``cfg.dtype``."""
    out = {}
    for name, shape in param_names(cfg):
        x = seeded_normal(shape, _seed_of(cfg.seed, name))
        out[name] = (0.1 * x) if _is_bias(name) else init_weight(name, shape, x).to(cfg.dtype)
    return out


def resolve_deepseek_impl(impl) -> dict:
    """:func:`~.model.resolve_impl`, with ``"two_forms"`` also allowed for the ``attention``
    family (``{"attention": "two_forms"}``: every other family invariant)."""
    if isinstance(impl, dict) and impl.get("attention") == "two_forms":
        return {**resolve_impl({**impl, "attention": "invariant"}), "attention": "two_forms"}
    if isinstance(impl, str) and impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or a dict (attention may be one of {ATTENTION_IMPLS}), "
                         f"got {impl!r}")
    return resolve_impl(impl)


def apply_rope_interleaved(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """DeepSeek's RoPE: the rotary dims of ``x`` ``(T, heads, rope_dim)`` come in interleaved pairs
    ``(x0, x1), (x2, x3), ...``; they are laid out as rotate-half (``x0, x2, ..., x1, x3, ...``,
    as transformers' ``apply_rotary_pos_emb_interleave`` does) and rotated by
    :func:`~.model.apply_rope`.  Queries and keys get the same layout, so their dot products are
    the interleaved rotation's."""
    T, h, d = x.shape
    return apply_rope(x.reshape(T, h, d // 2, 2).transpose(2, 3).reshape(T, h, d), positions, cos, sin)


@dataclass
class _Layer:
    in_norm: torch.Tensor
    qkv_a: torch.Tensor                 # [q_proj or q_a_proj ; kv_a_proj_with_mqa], fused
    q_a_norm: torch.Tensor | None
    q_b: torch.Tensor | None
    kv_a_norm: torch.Tensor
    w_kc: torch.Tensor                  # (heads, qk_nope, kv_lora_rank)
    w_vc: torch.Tensor                  # (heads, kv_lora_rank, v_head_dim)
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor | None = None
    down: torch.Tensor | None = None
    router: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    experts_gate_up: torch.Tensor | None = None
    experts_down: torch.Tensor | None = None
    shared_gate_up: torch.Tensor | None = None
    shared_down: torch.Tensor | None = None


class DeepSeekModel:
    """The decoder.  ``DeepSeekModel(cfg)`` draws the weights from ``cfg.seed``;
    ``DeepSeekModel.from_pretrained(folder)`` reads a ``DeepseekV3`` Hugging Face folder (one
    ``model.safetensors``), e.g. one written by :meth:`save_pretrained` or by
    :func:`batch_invariance_kit.vllm.deepseek_model.build`."""

    def __init__(self, cfg: DeepSeekConfig, weights: dict | None = None, device=None):
        if not isinstance(cfg, DeepSeekConfig):
            raise TypeError(f"cfg must be a DeepSeekConfig, got {type(cfg).__name__}")
        cfg.check()
        self.cfg = cfg
        self.device = DEVICE if device is None else torch.device(device)
        self.weights = random_weights(cfg) if weights is None else dict(weights)
        missing = [n for n, _ in param_names(cfg) if n not in self.weights]
        if missing:
            raise ValueError(f"weights lack {len(missing)} parameter(s) of this config, e.g. {missing[:3]}")
        dt, dev = cfg.dtype, self.device
        self.routing = cfg.routing()
        heads, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim

        def g(name, dtype=dt):
            return self.weights[name].to(dtype=dtype, device=dev).contiguous()

        self.embed = g("model.embed_tokens.weight")
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            lora = cfg.q_lora_rank is not None
            kv_b = g(a + "kv_b_proj.weight").view(heads, nope + v, cfg.kv_lora_rank)
            L = _Layer(in_norm=g(p + "input_layernorm.weight"),
                       qkv_a=torch.cat([g(a + ("q_a_proj.weight" if lora else "q_proj.weight")),
                                        g(a + "kv_a_proj_with_mqa.weight")]).contiguous(),
                       q_a_norm=g(a + "q_a_layernorm.weight") if lora else None,
                       q_b=g(a + "q_b_proj.weight") if lora else None, kv_a_norm=g(a + "kv_a_layernorm.weight"),
                       w_kc=kv_b[:, :nope].contiguous(), w_vc=kv_b[:, nope:].transpose(1, 2).contiguous(),
                       o=g(a + "o_proj.weight"), post_norm=g(p + "post_attention_layernorm.weight"))
            if i < cfg.first_k_dense_replace:
                L.gate_up = torch.cat([g(p + "mlp.gate_proj.weight"), g(p + "mlp.up_proj.weight")])
                L.down = g(p + "mlp.down_proj.weight")
            else:
                L.router = g(p + "mlp.gate.weight")
                L.bias = g(p + "mlp.gate.e_score_correction_bias", torch.float32)
                L.experts_gate_up = torch.stack([
                    torch.cat([g(f"{p}mlp.experts.{e}.gate_proj.weight"), g(f"{p}mlp.experts.{e}.up_proj.weight")])
                    for e in range(cfg.n_routed_experts)]).contiguous()
                L.experts_down = torch.stack([g(f"{p}mlp.experts.{e}.down_proj.weight")
                                              for e in range(cfg.n_routed_experts)]).contiguous()
                s = p + "mlp.shared_experts."
                L.shared_gate_up = torch.cat([g(s + "gate_proj.weight"), g(s + "up_proj.weight")])
                L.shared_down = g(s + "down_proj.weight")
            self.layers.append(L)
        self.norm = g("model.norm.weight")
        self.lm_head = g("lm_head.weight")
        self.cos, self.sin = rope_tables(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.max_position_embeddings, dev)

    # ---------------------------------------------------------------------------------- I/O
    def save_pretrained(self, folder: str) -> dict:
        """Write ``config.json`` and ``model.safetensors`` (HF names) to ``folder``; returns
        ``{"config": path, "weights": path, "format": "safetensors"}``."""
        return save_hf_folder(folder, self.cfg.hf_config(), self.weights)

    @classmethod
    def from_pretrained(cls, folder: str, device=None, torch_dtype: str | None = None) -> "DeepSeekModel":
        """Read a folder; ``torch_dtype``: compute in another dtype than the checkpoint's."""
        config, weights = read_hf_folder(folder)
        cfg = DeepSeekConfig.from_hf_config(config)
        return cls(cfg if torch_dtype is None else replace(cfg, torch_dtype=torch_dtype), weights, device=device)

    # ------------------------------------------------------------------------------ forward
    def new_kv_cache(self, num_blocks: int, block_size: int) -> list:
        """One paged latent cache ``(num_blocks, block_size, kv_lora_rank + rope_dim)`` per layer
        (the block table is shared by all layers)."""
        c = self.cfg
        return [M.new_latent_cache(num_blocks, block_size, c.kv_lora_rank, c.qk_rope_head_dim, dtype=c.dtype,
                                   device=self.device) for _ in range(c.num_hidden_layers)]

    @torch.no_grad()
    def forward(self, batch: StepBatch, kv_cache: list, *, impl="invariant", return_hidden: bool = False):
        """Run one step: writes the new tokens' latents into ``kv_cache`` and returns the fp32
        log-probabilities ``(len(logits_indices), vocab)`` of the next token (and the final-norm
        hidden states of those rows with ``return_hidden``).  ``impl``: see
        :func:`resolve_deepseek_impl`."""
        im = resolve_deepseek_impl(impl)
        c = self.cfg
        T = batch.tokens.shape[0]
        heads, nope, rope, lora, eps = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank,
                                        c.rms_norm_eps)
        x = self.embed[batch.tokens]
        residual = x
        h = RN.rms_norm(x, self.layers[0].in_norm, eps, impl=im["norm"])
        for i, L in enumerate(self.layers):
            qkv = linear(h, L.qkv_a, impl=im["linear"])
            q, kv = qkv[:, :L.qkv_a.shape[0] - lora - rope], qkv[:, L.qkv_a.shape[0] - lora - rope:]
            if L.q_b is not None:
                q = linear(RN.rms_norm(q.contiguous(), L.q_a_norm, eps, impl=im["norm"]), L.q_b, impl=im["linear"])
            q = q.reshape(T, heads, nope + rope)
            latent = RN.rms_norm(kv[:, :lora].contiguous(), L.kv_a_norm, eps, impl=im["norm"])
            k_pe = apply_rope_interleaved(kv[:, None, lora:], batch.positions, self.cos, self.sin)[:, 0]
            q_pe = apply_rope_interleaved(q[:, :, nope:], batch.positions, self.cos, self.sin)
            M.write_latent(latent, k_pe, kv_cache[i], batch.slot_mapping)
            o = M.mla(q[:, :, :nope], q_pe, kv_cache[i], batch.block_table, batch.seq_lens, batch.query_start_loc,
                      L.w_kc, L.w_vc, impl=im["attention"])
            o = linear(o.reshape(T, heads * c.v_head_dim), L.o, impl=im["linear"])
            h, residual = RN.fused_add_rms_norm(o, residual, L.post_norm, eps, impl=im["norm"])
            if L.router is None:
                m = swiglu_mlp(h, L.gate_up, L.down, impl=im["linear"])
            else:
                m = R.deepseek_moe(h, L.router, L.bias, L.experts_gate_up, L.experts_down, L.shared_gate_up,
                                   L.shared_down, self.routing, impl=im["moe"])
            nxt = self.layers[i + 1].in_norm if i + 1 < len(self.layers) else self.norm
            h, residual = RN.fused_add_rms_norm(m, residual, nxt, eps, impl=im["norm"])
        h = h[batch.logits_indices].contiguous()
        logprobs = torch.log_softmax(linear(h, self.lm_head, impl=im["linear"]).float(), dim=-1)
        return (logprobs, h) if return_hidden else logprobs
