"""Operations helpers (no Prefect import): run reports, plots, links to the UIs, the eval gate's
renderings. ``tasks/report.py`` and ``tasks/gate.py`` turn their output into Prefect artifacts."""
