"""``SubgraphMatcher`` and ``InternalMatch`` where torch.fx code imports them from.

They are defined in ``fxdist.subgraph_rewriter`` (the rewriter is their main user).

Source: torch/fx/passes/utils/matcher_utils.py.
"""

from fxdist.subgraph_rewriter import InternalMatch, SubgraphMatcher

__all__ = ["InternalMatch", "SubgraphMatcher"]
