"""One call from an engine error message and the failing config to a lesson condition.

:func:`ground_message` looks the message up in the source tree
(:func:`mcp_servers.source.raises.locate_message`) and builds the condition from the guard of
the best site (:func:`domain.grounding.grounded_condition`). It never raises for a message it
cannot ground: the answer then says why, and the caller uses the failure taxonomy's rule with
``verified=False``.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from domain.config import ServingConfig
from domain.grounding import NotGrounded, grounded_condition
from domain.lesson import Clause, Scope
from mcp_servers.source.flags import FlagInventory
from mcp_servers.source.raises import RaiseSite, locate_message
from mcp_servers.source.tree import SourceTree


class Grounding(BaseModel):
    """A lesson condition read from the engine's check, or why there is none."""

    verified: bool = Field(description="the condition comes from the guard of `site`")
    site: RaiseSite | None = Field(description="the best matching raise/assert site, if any")
    scope: Scope | None = Field(None, description="the lesson scope (when verified)")
    condition: list[Clause] = Field(default_factory=list, description="the clauses (when "
                                    "verified; never empty then)")
    reason: str | None = Field(None, description="why the condition is not verified")

    @property
    def source_site(self) -> str | None:
        """``file:line`` of the site, for ``Lesson.source_site``."""
        return self.site.site if self.site else None


def ground_message(tree: SourceTree, inv: FlagInventory, message: str,
                   config: ServingConfig, exception: str | None = None) -> Grounding:
    """The source-grounded condition for ``config`` failing with ``message``.

    ``verified`` is True only when a site matches, its guard gives a condition for the config
    and that condition has at least one clause (a forbidding lesson needs one; a guard that
    tests only the hardware or the model gives none).

    Raises:
        SourceError: an empty or overlong message (see ``locate_message``).
    """
    found = locate_message(tree, inv, message, exception, max_sites=1)
    if not found.sites:
        return Grounding(verified=False, site=None,
                         reason=f"no raise or assert in SGLang {tree.version or ''} prints "
                                "this message")
    site = found.sites[0]
    try:
        scope, clauses = grounded_condition(config, site.facts)
    except NotGrounded as e:
        return Grounding(verified=False, site=site, reason=str(e))
    if not clauses:
        return Grounding(verified=False, site=site, scope=scope,
                         reason=f"the guard of {site.site} ({site.guard}) tests no setting "
                                "of the config, only the hardware or the model")
    return Grounding(verified=True, site=site, scope=scope, condition=clauses)
