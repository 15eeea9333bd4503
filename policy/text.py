"""How decisions write numbers in their reasons: whole numbers bare, others to two decimals, no trailing zeros."""

from __future__ import annotations


def fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int) or value.is_integer():  # most loads are whole numbers: skip the formatting
        return str(int(value))
    return f"{value:.2f}".rstrip("0").rstrip(".")
