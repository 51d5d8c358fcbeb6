"""vLLM: the kit as a vLLM plugin, and the check that asks whether a vLLM deployment is batch-invariant.

* :mod:`.plugin`: the ``vllm.general_plugins`` entry point (inert unless ``KIT_BATCH_INVARIANT=1``);
* :mod:`.runner`: one engine in one mode, in its own process (the worker of every vLLM run: chapter
  7, ``check --model`` and the H200 check), its experiments and the bitwise checks of their results;
* :mod:`.chat`: chat requests for a real model;
* :mod:`.check`: ``python -m batch_invariance_kit.vllm.check`` (the kit's random-weight models on
  a GPU, or ``--model PATH`` on the present device), one JSON with provenance and a verdict;
* :mod:`.online`: ``python -m batch_invariance_kit.vllm.online``, the same question under a real
  server with concurrent clients;
* :mod:`.records`: what both checks share: the modes, the seeded prompts, the typed records of
  their results.
"""
