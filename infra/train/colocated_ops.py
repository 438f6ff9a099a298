"""Trainer ops of the ``colocated`` weight placement (mixed into :class:`infra.train.worker.Trainer`)."""

from __future__ import annotations


class ColocatedOps:
    """Ops a trainer rank runs for ``weight_sync.placement: colocated``."""
