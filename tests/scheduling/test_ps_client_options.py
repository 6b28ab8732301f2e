"""scheduling.ps.client_options: a PSClient's options, frozen and checked when built."""

from __future__ import annotations

import dataclasses

import pytest

from scheduling.ps import ClientOptions


def test_defaults_and_replace():
    opts = ClientOptions()
    assert opts.name == "ps" and opts.grad_divisor == 1
    group = opts.replace(rank=1, world_size=4, group="g")
    assert group.grad_divisor == 4 and group.replace(grad_reduction="sum").grad_divisor == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.name = "other"  # type: ignore[misc]


@pytest.mark.parametrize("fields, message", [
    ({"rank": 2, "world_size": 2}, "not in"), ({"world_size": 2}, "group key"),
    ({"grad_reduction": "max"}, "grad_reduction"), ({"storage": "int4"}, "storage"),
    ({"compress": "zip"}, "compress"),
])
def test_bad_options_raise(fields, message):
    with pytest.raises(ValueError, match=message):
        ClientOptions(**fields)
