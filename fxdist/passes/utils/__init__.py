"""Helpers shared by passes (mirrors ``torch.fx.passes.utils``)."""
