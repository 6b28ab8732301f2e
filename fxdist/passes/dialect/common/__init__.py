"""Passes for any functional dialect (``cse_pass``), mirroring ``torch.fx.passes.dialect.common``."""
