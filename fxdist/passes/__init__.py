"""Graph passes: the pass infrastructure (``PassBase``, ``PassResult``, ``PassManager``) and analyses.

Individual passes live in their own modules (``fxdist.passes.shape_prop``, ``fxdist.passes.reinplace``,
...) and are imported from there; only the infrastructure is re-exported here, plus ``ShapeProp`` and
``TensorMetadata`` resolved lazily so ``import fxdist.passes`` stays cheap.
"""

from __future__ import annotations

from typing import Any

from fxdist.passes.pass_base import PassBase, PassManager, PassResult, PassVerificationError

__all__ = ["PassBase", "PassManager", "PassResult", "PassVerificationError", "ShapeProp", "TensorMetadata"]


def __getattr__(name: str) -> Any:
    if name in ("ShapeProp", "TensorMetadata"):
        from fxdist.passes import shape_prop

        return getattr(shape_prop, name)
    raise AttributeError(f"module 'fxdist.passes' has no attribute {name!r}")
