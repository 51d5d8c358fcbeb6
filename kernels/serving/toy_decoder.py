"""A tiny seeded random-weight decoder in plain torch, for chapter 1's demonstration.

Plain torch ops (``torch.mm`` for every projection), so it inherits whatever batch
dependence the present device's BLAS has.  A request is decoded greedily *together with*
``load`` other requests (a simulated server load): the projections then see
``M = (1 + load) * seq_len`` rows, and the request's logprobs may change with the load.
``alone=True`` decodes the request by itself every time (the batch-invariant control).
(Chapter 7's Qwen3-style model on the kit's own kernels is the real end-to-end check.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import positive_int
from ..verify.harness import seeded_normal


@dataclass
class Completion:
    tokens: tuple
    logprobs: torch.Tensor  # fp32, one per generated token

    def key(self) -> tuple:
        """The bitwise identity of the logprob sequence."""
        return tuple(self.logprobs.view(torch.int32).tolist())


class ToyDecoder:
    def __init__(self, vocab: int = 512, hidden: int = 256, layers: int = 2, heads: int = 4,
                 ffn: int = 512, seed: int = 0, dtype: torch.dtype = torch.float32, device=None):
        for name, v in (("vocab", vocab), ("hidden", hidden), ("layers", layers), ("heads", heads), ("ffn", ffn)):
            positive_int(name, v)
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        if device is None:
            from ..device import DEVICE as device
        self.vocab, self.hidden, self.heads, self.dtype, self.device = vocab, hidden, heads, dtype, device
        counter = iter(range(seed * 1000, seed * 1000 + 1000))

        def w(*shape, scale):
            return (seeded_normal(shape, next(counter)) * scale).to(dtype=dtype, device=device)

        self.emb = w(vocab, hidden, scale=1.0)
        self.layers = [
            dict(qkv=w(hidden, 3 * hidden, scale=hidden ** -0.5), o=w(hidden, hidden, scale=hidden ** -0.5),
                 up=w(hidden, 2 * ffn, scale=hidden ** -0.5), down=w(ffn, hidden, scale=ffn ** -0.5))
            for _ in range(layers)
        ]
        self.lm_head = w(hidden, vocab, scale=4 * hidden ** -0.5)

    @staticmethod
    def _norm(x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, cache: list | None = None):
        """(B, t) new token ids -> ((B, t, vocab) fp32 logits, cache).

        ``cache`` holds each layer's keys and values of the earlier positions (a KV cache):
        prefill passes the whole prompt, each decode step one token per sequence, so that
        every projection is one ``torch.mm`` over ``M = B * t`` rows, as in a server."""
        B, t = tokens.shape
        H, nh = self.hidden, self.heads
        d = H // nh
        past = 0 if not cache else cache[0][0].shape[2]
        x = self.emb[tokens].reshape(B * t, H)
        causal = torch.ones(t, past + t, dtype=torch.bool, device=self.device).tril(past)
        new_cache = []
        for i, L in enumerate(self.layers):
            q, k, v = torch.mm(self._norm(x), L["qkv"]).split(H, dim=1)
            q, k, v = (z.reshape(B, t, nh, d).transpose(1, 2) for z in (q, k, v))
            if cache:
                k = torch.cat([cache[i][0], k], dim=2)
                v = torch.cat([cache[i][1], v], dim=2)
            new_cache.append((k, v))
            s = (q.float() @ k.float().transpose(-1, -2)) * d ** -0.5
            p = s.masked_fill(~causal, float("-inf")).softmax(-1)
            a = (p @ v.float()).to(self.dtype).transpose(1, 2).reshape(B * t, H)
            x = x + torch.mm(a, L["o"])
            g, u = torch.mm(self._norm(x), L["up"]).chunk(2, dim=1)
            x = x + torch.mm(torch.nn.functional.silu(g) * u, L["down"])
        logits = torch.mm(self._norm(x), self.lm_head).float().reshape(B, t, self.vocab)
        return logits, new_cache

    @torch.no_grad()
    def generate(self, prompt, n_new: int, *, load: int = 0, load_seed: int = 0, alone: bool = False) -> Completion:
        """Greedy-decode ``prompt`` for ``n_new`` tokens next to ``load`` other random requests.

        Prefill runs the prompts of the whole batch together, then each decode step runs one
        token of every sequence together (``M = 1 + load`` rows)."""
        positive_int("n_new", n_new)
        if isinstance(load, bool) or not isinstance(load, int) or load < 0:
            raise ValueError(f"load must be a non-negative int, got {load!r}")
        prompt = torch.as_tensor(prompt, dtype=torch.long, device=self.device).reshape(1, -1)
        if prompt.numel() == 0:
            raise ValueError("prompt must not be empty")
        if int(prompt.min()) < 0 or int(prompt.max()) >= self.vocab:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab})")
        g = torch.Generator().manual_seed(load_seed)
        others = torch.randint(0, self.vocab, (load, prompt.shape[1]), generator=g).to(self.device)
        step = torch.cat([prompt, others]) if not alone else prompt
        cache = None
        out_tokens, out_lp = [], []
        for _ in range(n_new):
            logits, cache = self.forward(step, cache)
            lp = torch.log_softmax(logits[:, -1], dim=-1)
            nxt = lp.argmax(-1)
            out_tokens.append(int(nxt[0]))
            out_lp.append(lp[0, nxt[0]])
            step = nxt[:, None]
        return Completion(tuple(out_tokens), torch.stack(out_lp).cpu())
