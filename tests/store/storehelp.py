"""Helpers shared by the store tests."""

from __future__ import annotations


def policy(max_cost_micros: int = 40_000, **extra: object) -> dict[str, object]:
    return {
        "web": False,
        "shell": True,
        "files": [],
        "connections": [],
        "zero_data_retention": False,
        "timeout_seconds": 120,
        "max_cost_micros": max_cost_micros,
        "isolation": "auto",
        **extra,
    }
