"""Helpers shared by the structure builders."""

from __future__ import annotations


def largest_pow2_divisor(n: int) -> int:
    """The largest power of two dividing ``n`` (PyJuice's default block size rule)."""
    if n <= 0:
        raise ValueError(f"expected a positive int, got {n}")
    return n & -n


def default_block_size(num_latents: int, cap: int) -> int:
    return min(largest_pow2_divisor(num_latents), cap)


def check_latents(name: str, num_latents: int, block_size: int | None, cap: int) -> tuple[int, int]:
    """``(block_size, num_node_blocks)`` with a clear error when they do not fit."""
    if not isinstance(num_latents, int) or isinstance(num_latents, bool) or num_latents < 1:
        raise ValueError(f"{name}: num_latents must be a positive int, got {num_latents!r}")
    bs = default_block_size(num_latents, cap) if block_size is None else block_size
    if not isinstance(bs, int) or bs < 1 or num_latents % bs:
        raise ValueError(f"{name}: num_latents={num_latents} must be a multiple of block_size={bs}")
    return bs, num_latents // bs
