"""The rule table of FBGEMM lowering (:mod:`quant.rules`)."""

from __future__ import annotations

from quant.rules import RULES


def test_rule_table_documents_each_rule():
    """Every rule has a name and its rewrite's source carries a ``# before -> after`` comment."""
    import inspect

    assert len({r.name for r in RULES}) == len(RULES) >= 5
    for rule in RULES:
        assert "->" in inspect.getsource(rule.rewrite), rule.name
