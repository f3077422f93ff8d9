"""Integer helpers for launch grids and tile sizes, as plain Python.

``triton.cdiv`` and ``triton.next_power_of_2`` are ``constexpr_function`` objects in recent
Triton: called from host code each one unwraps its arguments first (a few microseconds a
call, measured on the H200 host), which adds up in the launchers of small eager calls.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, ``b > 0``."""
    return -(-a // b)


def next_pow2(x: int) -> int:
    """The smallest power of two ``>= x`` (1 for ``x <= 1``)."""
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def prev_pow2(x: int) -> int:
    """The largest power of two ``<= x`` (1 for ``x <= 1``)."""
    return 1 << max(0, x.bit_length() - 1)
