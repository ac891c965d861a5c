"""Secret randomness: one ChaCha20 key per run, every draw a pure function of (key, purpose, step,
index). Poisson sampling, the Gaussian noise and the keyed per-example draws of every method come
from here; nothing on the secret path uses a seeded torch or numpy generator."""

from .draws import (band_labels, batch_keys, box_muller, inclusion_threshold, int_list, keyed_ints, keyed_normal,
                    normals, poisson_indices, secret_int, stream, uint64s)
from .key import PROBE_STEP, Purpose, SecretKey, check_seed
from .noise import noise_grid, snap, snapped_gaussian
from . import forward

__all__ = ["PROBE_STEP", "Purpose", "SecretKey", "band_labels", "batch_keys", "box_muller", "check_seed", "inclusion_threshold",
           "int_list", "keyed_ints", "keyed_normal", "noise_grid", "normals", "poisson_indices", "secret_int", "snap",
           "snapped_gaussian", "stream", "uint64s"]
