"""torch.fx conformance: the same program run with ``torch.fx`` and ``fxdist`` gives the same graph,
result, printed text and exception class (fxdist is a drop-in for torch.fx)."""
