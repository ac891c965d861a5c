"""``SecretKey``: the 256-bit key of every secret draw of a run, and the addresses of the draws.

A draw is named by ``(purpose, step, index)``: what it is for (``Purpose``), the training step (or
the sampler's batch counter, the noise stage's draw counter) and the example index (0 where the
draw is not per example). The address is ChaCha20's 96-bit nonce, so a draw is a pure function of
the key and its address (``clipbias.randomness.chacha``).

The key comes from the operating system's CSPRNG (``secrets``, 256 bits) unless a seed is given for
a reproducible run; then it is a hash of all the seed's bits (up to 256), and the guarantee holds
only while the seed stays secret and unguessable (``reproducible``). There is no integer seed to
enumerate otherwise: unlike torch's and numpy's generators, nothing truncates the key.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
import weakref

import torch

from ..errors import ConfigError

KEY_BYTES = 32
SEED_BITS = 256
STEP_BITS, INDEX_BITS = 48, 40
PROBE_STEP = (1 << STEP_BITS) - 1
"""The step of measurement probes (diagnostics): never a training step."""


@enum.unique  # two purposes with one number would silently share a stream
class Purpose(enum.IntEnum):
    """What a draw is for: one independent stream each. A new draw gets a new number, never a used one."""

    SAMPLE = 1    # Poisson inclusion of every example (per sampler batch)
    NOISE = 2     # the Gaussian noise of the released update (per noise draw)
    PERTURB = 3   # pre-clipping perturbation (per step and example)
    AUGMENT = 4   # self-augmentation codes (per step and example)
    GROUP = 5     # p-averaging groups (per step and example)
    PUBLIC = 6    # BatchClipping's public partners (per step and example)
    PREDICT = 7   # BatchClipping's inference draws (per vote and test example)
    LOADER = 8    # DataLoader worker seeds (the user's own dataset randomness, per epoch start)
    PERTURB_BATCH = 9  # pre-clipping perturbation of rows without example indices (per step and call)
    CLIP_COUNT = 10    # adaptive clipping: the noisy count of unclipped rows (per release)
    TUNE = 11          # tuning: the number of trials (step 0), each trial's hyperparameters and key (step 1 + trial)
    TUNE_SCORE = 12    # tuning: the noisy validation count of each trial (per trial)
    TUNE_SPLIT = 13    # tuning: which training examples form the validation part (one draw)
    BAND = 14          # banded noise: each example's participation class mod b (one draw)
    FORWARD = 15       # retired (the dropout masks of one forward pass in one stream, each call after the
                       # previous call's blocks: padded sizes moved later calls; never reuse)
    VALIDATION_SPLIT = 17  # --validation: which training examples form the validation part (one draw)
    HOLDOUT = 18           # --public-source holdout: which training examples are held out (one draw)
    FORWARD_CALL = 19      # the private forward pass's dropout masks: one stream per (step, dropout call of the
                           # forward pass, example); the step field holds the step (low 32 bits) and the call
                           # number (high 16 bits): ``forward_call_step``; layout: clipbias.randomness.forward
    EXAMPLE_FETCH = 40     # ``clipbias.example_generator`` in a Dataset's __getitem__/__getitems__: one stream per
                           # (step, draw, example); step field: the step (low 32 bits), the draw's number in the
                           # example's fetch (high 16 bits): ``clipbias.randomness.example``
    EXAMPLE_COLLATE = 41   # the same in the collate_fn (per step, draw and example)
    REFETCH = 42           # which example of a step's batch the loader fetches again to check it (per step)


class SecretKey:
    """The key of all secret draws of one run. Never printed; saved only in private checkpoints.

    Build it with ``generate()`` (the default of every private run), ``from_seed(seed)`` or ``of(...)``.

    Args:
        key: The raw key, 32 bytes.
        reproducible: Whether it comes from a seed (then a run under it is reported uncertified).

    Raises:
        ConfigError: a key that is not 32 bytes.
    """

    __slots__ = ("_key", "reproducible", "_owner")

    def __init__(self, key: bytes, reproducible: bool) -> None:
        if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
            raise ConfigError(f"a secret key is {KEY_BYTES} bytes")
        self._key, self.reproducible, self._owner = bytes(key), bool(reproducible), None

    def adopt(self, owner: object) -> None:
        """Bind the key to the one engine that draws under it. Two engines under one key draw the same
        batches and the same noise: releasing both reveals the difference of their updates without
        noise. A key from the OS therefore drives one engine (a seeded key is already uncertified)."""
        previous = self._owner() if self._owner is not None else None
        if previous is not None and previous is not owner and not self.reproducible:
            raise ConfigError("this SecretKey already drives another DPEngine: two engines under one key draw the "
                              "same batches and noise, so releasing both reveals their difference without noise. "
                              "Give each engine its own key (the default, noise_seed=None)")
        self._owner = weakref.ref(owner)

    @classmethod
    def generate(cls) -> "SecretKey":
        """256 fresh bits from the OS CSPRNG: the default for every private run."""
        return cls(secrets.token_bytes(KEY_BYTES), reproducible=False)

    @classmethod
    def from_seed(cls, seed: int) -> "SecretKey":
        """A reproducible key: BLAKE2b of all bits of ``seed``.

        Args:
            seed: An integer in [0, 2^256); the guarantee holds only while it stays secret and unguessable.

        Returns:
            The key, marked ``reproducible``.

        Raises:
            ConfigError: a seed that is not an integer in [0, 2^256).
        """
        seed = check_seed(seed)
        digest = hashlib.blake2b(seed.to_bytes(SEED_BITS // 8, "little"), digest_size=KEY_BYTES,
                                 person=b"clipbias-key-v1").digest()
        return cls(digest, reproducible=True)

    @classmethod
    def of(cls, seed: "int | SecretKey | None") -> "SecretKey":
        """A key from what an API was given.

        Args:
            seed: A ``SecretKey`` (returned as it is), a seed (``from_seed``), or None (a fresh OS key:
                ``generate``).

        Returns:
            The key.
        """
        if isinstance(seed, SecretKey):
            return seed
        return cls.generate() if seed is None else cls.from_seed(seed)

    @property
    def bytes(self) -> bytes:
        """The raw key (for the cipher, the private checkpoint and the rank-0 broadcast only)."""
        return self._key

    def state_dict(self) -> dict:
        return {"key": torch.tensor(list(self._key), dtype=torch.uint8), "reproducible": self.reproducible}

    @classmethod
    def from_state(cls, state: dict) -> "SecretKey":
        if not isinstance(state, dict) or "key" not in state:
            raise ConfigError("not a secret-key state (SecretKey.state_dict())")
        return cls(bytes(state["key"].tolist()), bool(state.get("reproducible", True)))  # unknown: not certified

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SecretKey) and hmac.compare_digest(self._key, other._key)

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return f"SecretKey(<secret>, {'from a seed' if self.reproducible else 'from the OS CSPRNG'})"


def check_seed(seed: object) -> int:
    """A reproducible-noise seed: an integer in [0, 2^256)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < (1 << SEED_BITS):
        raise ConfigError(f"a noise seed must be an integer in [0, 2^{SEED_BITS}), got {seed!r}")
    return seed


def derive_seed(seed: int, *parts: int) -> int:
    """A 256-bit seed from ``seed`` and the integers ``parts`` (BLAKE2b): distinct runs of one reproducible
    experiment (the seeds of a comparison) get distinct keys from one secret seed."""
    data = check_seed(seed).to_bytes(SEED_BITS // 8, "little") + b"".join(
        int(p).to_bytes(16, "little", signed=True) for p in parts)
    return int.from_bytes(hashlib.blake2b(data, digest_size=32, person=b"clipbias-derive").digest(), "little")


FORWARD_STEP_BITS, CALL_BITS = 32, 16
assert FORWARD_STEP_BITS + CALL_BITS == STEP_BITS


def forward_call_step(step: int, call: int) -> int:
    """The step field of a ``Purpose.FORWARD_CALL`` address: ``step`` (< 2^32) in the low bits, the
    dropout call number of the forward pass (< 2^16) above it."""
    if not 0 <= step < (1 << FORWARD_STEP_BITS):
        raise ConfigError(f"keyed dropout masks are addressed by a step below 2^{FORWARD_STEP_BITS}; got step {step}")
    if not 0 <= call < (1 << CALL_BITS):
        raise ConfigError(f"the model's forward pass makes more than {(1 << CALL_BITS) - 1} keyed dropout calls "
                          f"(call {call}): each call has its own keystream address, of {CALL_BITS} bits")
    return step | (call << FORWARD_STEP_BITS)


def nonce(purpose: int, step: int, index: int) -> bytes:
    """The 96-bit ChaCha20 nonce of a draw: purpose (8 bits), step (48 bits), index (40 bits)."""
    if not (0 < purpose < 256 and 0 <= step < (1 << STEP_BITS) and 0 <= index < (1 << INDEX_BITS)):
        raise ValueError(f"draw address out of range: purpose {purpose}, step {step} (< 2^{STEP_BITS}), "
                         f"index {index} (< 2^{INDEX_BITS})")
    return bytes([purpose]) + step.to_bytes(STEP_BITS // 8, "little") + index.to_bytes(INDEX_BITS // 8, "little")
