"""cupaged inside the frameworks.

- :mod:`cupaged.integrations.torch_ops`: ``torch.ops.cupaged.*``, custom operators with
  fake implementations, for ``torch.compile`` (no graph break), ``torch.library.opcheck``
  and CUDA graphs. Registered by ``import cupaged`` when torch is already imported, or by
  importing the module.
- :mod:`cupaged.integrations.transformers`: a paged attention implementation for Hugging
  Face transformers' continuous batching, over transformers' own paged cache.

Nothing here is imported by ``import cupaged`` unless torch already is.
"""
