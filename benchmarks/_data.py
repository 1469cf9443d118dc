"""Synthetic image data for speed runs (BENCHMARKS.md): Gaussian-blurred white noise (sigma 2 px),
contrast-normalized, squashed by a sigmoid and quantized to 256 levels."""

from __future__ import annotations

import numpy as np
from scipy.ndimage import gaussian_filter


def blurred_noise_images(n: int, shape=(28, 28), levels: int = 256, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    z = gaussian_filter(rng.standard_normal((n, *shape)), sigma=(0, 2, 2))
    z = (z - z.mean(axis=(1, 2), keepdims=True)) / (z.std(axis=(1, 2), keepdims=True) + 1e-8)
    img = 1.0 / (1.0 + np.exp(-2.0 * z))
    return np.minimum((img * levels).astype(np.int32), levels - 1).reshape(n, -1)
