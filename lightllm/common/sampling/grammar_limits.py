"""The llguidance parser limits every grammar runs under (the HTTP process's checks and the model rank's matchers).

llguidance's default allows 50,000 Earley items in one mask step.  An ambiguous grammar (a Lark rule
``x: x x | x x x | "a"``, 37 characters, far under the compiled-size limit) needs more items with
every token it emits, and its mask cost grows with them: measured at 14 ms per step after 175
tokens, 112 ms after 450, in the model rank's step, where every request of the batch waits for it.
One such request with ``min_tokens`` slowed every other client 10-300x for minutes.  At
:data:`STEP_MAX_ITEMS` it ends with llguidance's "Too many items" error after about a hundred
tokens (a few milliseconds per step at most), and the request finishes as ``grammar_failed`` (a 400).
JSON-schema grammars stay far below it: random walks of 400 tokens through nested, recursive,
``anyOf`` and open-object schemas never reached 1,000 items; an ambiguous arithmetic grammar
(``e: e "+" e | e "*" e | NUMBER``) ran 600 tokens under it.  A recursive schema nested about 60
levels deep reaches it: one with no finite instance (an array that must hold one more array) does so.
"""

from __future__ import annotations

from typing import Any

STEP_MAX_ITEMS = 2000


def grammar_limits() -> Any:
    """The ``llguidance.LLParserLimits`` for a matcher or a grammar check (llguidance imported lazily)."""
    import llguidance

    return llguidance.LLParserLimits(step_max_items=STEP_MAX_ITEMS)
