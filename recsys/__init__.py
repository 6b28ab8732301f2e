"""Recommendation-model building blocks shared by the layers above: ``scheduling``, ``quant`` and ``jobs``.

A leaf: it imports torch, torchrec and fxdist, never ``scheduling``, ``quant`` or ``jobs`` (tests/test_layout.py).

- :mod:`recsys.criteo`: the Criteo tables, torchrec's ``DLRM`` built for them, and Criteo batches as
  ``KeyedJaggedTensor``.
- :mod:`recsys.embedding`: which modules are embedding modules (torchrec ``EmbeddingBagCollection`` /
  ``EmbeddingCollection`` and their quantized forms, ``nn.EmbeddingBag``, ``nn.Embedding``), and
  :class:`~recsys.embedding.EmbeddingLeafTracer`, which keeps each one a single ``call_module`` node.
"""
