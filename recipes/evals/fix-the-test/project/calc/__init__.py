"""A tiny arithmetic package; the eval's setup breaks one of its functions."""

from calc.ops import add, mul, sub

__all__ = ["add", "mul", "sub"]
