"""Sections of the run configuration (one module per area); import them from :mod:`infra.config`."""
