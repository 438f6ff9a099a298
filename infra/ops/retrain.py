"""What a scheduled retrain starts from: the current champion, pinned by version.

The alias is resolved once, when the retrain begins, and the run is started from
``models:/<name>/<version>`` so its lineage names the exact model it continued from even if the
alias moves while it trains. With no champion yet, retraining either starts from the configured
base model (the first scheduled run bootstraps the registry) or fails, as the caller chooses.
"""

from __future__ import annotations

from infra.config import load_config
from infra.registry import Registry


def retrain_overrides(config: str, overrides: list[str], allow_scratch: bool = True) -> tuple[list[str], str]:
    """``overrides`` plus ``init_from`` pointing at the champion's version; and a one-line note."""
    cfg = load_config(config, overrides)
    reg = Registry(cfg.resolved_tracking_uri(), cfg.tracking.registered_model)
    champ = reg.alias(cfg.promote.alias)
    if champ is not None:
        ref = f"models:/{reg.name}/{champ.version}"
        return [*overrides, f"init_from={ref}"], f"retraining from {cfg.promote.alias} = {ref}"
    if not allow_scratch:
        raise LookupError(f"no {cfg.promote.alias!r} for {reg.name!r} in {cfg.resolved_tracking_uri()}; "
                          "run rl-train once (or set allow_scratch) to create one")
    return list(overrides), f"no {cfg.promote.alias} yet: training from the configured base model"
