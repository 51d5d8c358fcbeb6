"""Chat requests for a live vLLM run with a real model (chapter 7 and ``check --model``).

``TARGETS`` are the questions whose answers are compared alone and under load; ``FILLERS`` are
the other requests of the batch (different lengths, different output lengths).  Both go
through the model's own chat template, so the prompts are what a chat user would send.
"""
from __future__ import annotations

import random

TARGETS = (
    "Why is the sky blue?",
    "What does a compiler do?",
    "Give me three tips for sleeping well.",
    "Explain photosynthesis to a child.",
    "What is the difference between weather and climate?",
    "How do vaccines work?",
)

_TOPICS = ("the sea", "a lighthouse", "autumn leaves", "a city at night", "a cup of tea", "the moon",
           "a mountain trail", "a lost key", "a library", "a thunderstorm", "a garden", "an old clock")
_TASKS = ("Write a short poem about {}.", "Describe {} in two sentences.", "List five words related to {}.",
          "Tell a very short story about {}.")

FILLERS = tuple(task.format(topic) for topic in _TOPICS for task in _TASKS)


def encode(tokenizer, question: str) -> list:
    """Token ids of one user turn through the chat template, ready for the assistant's answer."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def chat_spec(folder, *, targets: int = 6, fillers: int = 24, max_tokens: int = 24, orders=(0, 1),
              decode_vs_prefill: int = 2, seed: int = 0, dtype: str = "bfloat16", eager: bool = False) -> dict:
    """A :func:`batch_invariance_kit.vllm.runner.make_spec` experiment of chat prompts for the
    model in ``folder`` (its tokenizer): the first ``targets`` questions, ``fillers`` requests
    drawn by ``seed`` with output lengths of 4 to ``2 * max_tokens`` tokens; ``eager``: every mode
    with ``enforce_eager=True`` (default: compiled, as vLLM ships)."""
    from transformers import AutoTokenizer

    from .runner import make_spec

    if not (1 <= targets <= len(TARGETS)):
        raise ValueError(f"targets must be in [1, {len(TARGETS)}], got {targets}")
    if not (0 <= fillers <= len(FILLERS)):
        raise ValueError(f"fillers must be in [0, {len(FILLERS)}], got {fillers}")
    tok = AutoTokenizer.from_pretrained(folder)
    rng = random.Random(seed)
    chosen = rng.sample(FILLERS, fillers)
    return make_spec([encode(tok, q) for q in TARGETS[:targets]], [encode(tok, q) for q in chosen],
                     max_tokens=max_tokens, filler_max_tokens=[rng.randint(4, 2 * max_tokens) for _ in chosen],
                     orders=orders, decode_vs_prefill=decode_vs_prefill, dtype=dtype, eager=eager)
