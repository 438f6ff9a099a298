"""Pipeline stages as plain typed functions (no Prefect): the logic behind each ``tasks/`` wrapper.

The flow threads a :class:`~infra.stages.context.RunContext` (config, ids, store, tracker) and a
:class:`~infra.stages.context.Cluster` (the long-lived services) through these functions.
"""
