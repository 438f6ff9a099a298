"""Trainer ops of the ``broadcast`` weight placement (mixed into :class:`infra.train.worker.Trainer`)."""

from __future__ import annotations


class BroadcastOps:
    """Ops a trainer rank runs for ``weight_sync.placement: broadcast``."""
