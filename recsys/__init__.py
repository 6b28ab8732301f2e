"""Recommendation-model building blocks shared by the layers above: ``scheduling``, ``quant`` and ``jobs``.

A leaf: it imports torch, torchrec, numpy and fxdist, never ``scheduling``, ``quant`` or ``jobs``
(tests/test_layout.py).

- :mod:`recsys.criteo`: the Criteo tables, torchrec's ``DLRM`` built for them, and Criteo batches as
  ``KeyedJaggedTensor``.
- the one Criteo reader of every layer: :mod:`recsys.criteo_format` (the format, the checks of a line and of a
  file, the one id hash), :mod:`recsys.criteo_parse` (the vectorised chunk parser), :mod:`recsys.criteo_shard`
  (trainers' shares, rows in memory, the first pass), :mod:`recsys.criteo_stream` (the streaming reader) and
  :mod:`recsys.criteo_synth` (the one synthetic generator).
- :mod:`recsys.movielens`: the one reader of MovieLens-100K's ``u.data``; :mod:`recsys.shared_data`: the one
  helper that finds ``../shared/data`` beside the repository.
- :mod:`recsys.embedding`: which modules are embedding modules (torchrec ``EmbeddingBagCollection`` /
  ``EmbeddingCollection`` and their quantized forms, ``nn.EmbeddingBag``, ``nn.Embedding``), and
  :class:`~recsys.embedding.EmbeddingLeafTracer`, which keeps each one a single ``call_module`` node.
- :mod:`recsys.quiet`: known torch and Ray noise dropped where it is made; importing :mod:`recsys` drops torch.fx's
  ``is_fx_tracing will return true ...`` notice, which every ``KeyedJaggedTensor`` construction caused.
"""

from recsys.quiet import quiet_fx_tracing_notice as _quiet_fx_tracing_notice

_quiet_fx_tracing_notice()
