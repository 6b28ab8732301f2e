"""Experimental fxdist tools: ATen-level capture (``make_fx``), mirroring ``torch.fx.experimental``."""
