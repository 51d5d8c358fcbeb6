"""A stand-in for :class:`batch_invariance_kit.vllm.runner.Engine` without vLLM: deterministic
completions from the prompt, the output length and, for a batch-variant engine, the batch's size.

Used by ``tests/test_vllm_runner.py`` and ``tests/test_vllm_check.py`` to run the worker's
experiment loop and the checks on a CPU in milliseconds."""


class FakeEngine:
    def __init__(self, variant: bool = False, fail_at: int | None = None):
        """``fail_at``: the ``generate`` call (counted among those that ran) that raises, once."""
        self.variant, self.fail_at, self.batches = variant, fail_at, []

    @classmethod
    def builder(cls, **kw):
        """A ``build(model, options, doc)`` for :func:`~batch_invariance_kit.vllm.runner.run_worker`."""
        def build(model, options, doc):
            doc["llm_kwargs"] = {"model": "<model folder>", **options}
            return cls(**kw)
        return build

    def info(self) -> dict:
        return {"enforce_eager": True, "compilation_mode": "0"}

    def generate(self, prompts: list, max_tokens: list) -> list:
        if self.fail_at is not None and len(self.batches) == self.fail_at:
            self.fail_at = None   # once
            raise RuntimeError("the fake engine's forward failed")
        self.batches.append(len(prompts))
        shift = len(prompts) * 2 ** -20 if self.variant and len(prompts) > 1 else 0.0
        return [{"tokens": [(sum(p) + k) % 50 for k in range(n)],
                 "logprobs": [-(1 + (sum(p) + k) % 7) / 8 + shift for k in range(n)], "text": None}
                for p, n in zip(prompts, max_tokens)]

    def prefill(self, prompt: list, completion: dict) -> dict:
        shift = 2 ** -12 if self.variant else 0.0
        return {"prompt_len": len(prompt), "decode": completion["logprobs"],
                "prefill": [x + shift for x in completion["logprobs"]], "last_token_equal": True}
