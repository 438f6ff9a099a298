"""``flows/capacity.py`` without a Prefect server: capacity is not enforced and one line says so."""

from __future__ import annotations

import pytest


def test_without_a_prefect_server_capacity_is_not_enforced_and_said(capsys: pytest.CaptureFixture[str]) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.capacity import enforced, hold_capacity

    with temporary_settings(updates={PREFECT_API_URL: None}):
        assert not enforced()
        with hold_capacity("train") as held:
            assert held == []
    assert "capacity: not enforced (no Prefect server: PREFECT_API_URL is unset)" in capsys.readouterr().err


def test_unknown_kind_names_the_known_ones() -> None:
    from flows.capacity import hold_capacity

    with pytest.raises(ValueError, match=r"unknown capacity kind 'big'; known: \['gate', 'train'\]"):
        with hold_capacity("big"):
            pass
