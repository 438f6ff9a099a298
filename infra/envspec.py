"""Names of the environment's task families, shared by the config and the environment.

The config validates ``env.families`` before anything starts, and ``evals/funcfit.py`` draws its
problems from the same families. Both import the names from here, so the config layer (below
``evals/``) never imports the environment and the list exists once.
"""

from __future__ import annotations

FUNCFIT_FAMILIES: tuple[str, ...] = ("x+b", "b-x", "x*x+b", "a*x+b", "x%a+b")


def check_families(families: tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """The funcfit family subset to draw from (all when ``None``), in the given order without repeats.

    Raises ``ValueError`` naming the unknown families (or an empty selection) and listing the known ones.
    """
    if families is None:
        return FUNCFIT_FAMILIES
    fams = tuple(dict.fromkeys(families))
    unknown = [f for f in fams if f not in FUNCFIT_FAMILIES]
    if unknown or not fams:
        raise ValueError(f"unknown function families {unknown or '(none given)'}; "
                         f"known: {', '.join(FUNCFIT_FAMILIES)}")
    return fams
