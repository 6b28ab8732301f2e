"""Dialect passes, mirroring ``torch.fx.passes.dialect`` (``common``: passes for any functional dialect)."""
