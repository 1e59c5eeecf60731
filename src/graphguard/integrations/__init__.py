"""Adapters that graph other people's model code with graphguard, without editing it.

Each adapter is an optional extra and is imported on its own, so ``import graphguard``
never imports a third-party model library:

- :mod:`graphguard.integrations.transformers` (``pip install ".[transformers]"`` in a checkout):
  :class:`~graphguard.integrations.transformers.GraphedCausalLM`, graphed greedy and
  sampled generation for Hugging Face causal LMs (Llama, Qwen2, Qwen3, Mistral, Phi-3,
  GPT-2 and others that pass its checks) over one ``StaticCache``.
"""
