"""Secret draws from a ``SecretKey``: uniform bits, Poisson inclusion, integers, standard normals.

Each function takes the key and the draw's address ``(purpose, step, index)`` and returns the same
values whenever it is called with them (no state), on any device. ``keyed_*`` draw one row per
example key (the example's index, or its position in the logical batch when indices are unknown),
so the rows are independent of how a batch is split into micro-batches or ranks.

Normals: Box-Muller in float64. The radius uses 128 random bits, so the tails reach 13.37 standard
deviations (a pair's radius exceeds r with probability exp(-r^2 / 2), 2^-129 at the end); the angle
uses 64 bits. Rounding onto a grid (``clipbias.randomness.noise``) happens after the noise is
added, never here.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Iterable, Iterator

import numpy as np
import torch
from torch import Tensor

from .chacha import BLOCK_BYTES, chacha20_words, keystream, triton_kernel
from .key import Purpose, SecretKey, nonce

PAIR_BYTES = 24                    # three 64-bit integers per pair of normals
_CHUNK_PAIRS = 1 << 20             # normals are made 2^21 at a time (bounded temporary memory)
_GPU_KEYSTREAM_PAIRS = 1 << 18     # on a GPU, larger draws compute the keystream there (torch kernel)
_TRITON_KEYSTREAM_PAIRS = 1 << 16  # the same with the Triton kernel (``_on_device``)
_TORCH_BLOCKS = 1 << 20            # keystream blocks per torch ChaCha20 call (~300 MB of temporaries)
_T32, _T64 = 2.0 ** 32, 2.0 ** -64
assert _CHUNK_PAIRS % 8 == 0, "a chunk's H, L, A runs must each start on a 64-byte keystream block"
_M32 = float(0xFFFFFFFF)


def stream(key: SecretKey, purpose: int, step: int, index: int, nbytes: int, counter: int = 0) -> np.ndarray:
    """``nbytes`` secret bytes (uint8) at the address ``(purpose, step, index)``."""
    return keystream(key.bytes, nonce(purpose, step, index), nbytes, counter)


def uint64s(key: SecretKey, purpose: int, step: int, index: int, count: int) -> np.ndarray:
    """``count`` uniform 64-bit integers (numpy uint64)."""
    return stream(key, purpose, step, index, 8 * count).view("<u8")


def secret_int(key: SecretKey, purpose: int, step: int, index: int = 0) -> int:
    """One uniform 63-bit integer (e.g. the seed of a generator off the secret path)."""
    return int(uint64s(key, purpose, step, index, 1)[0]) >> 1


def inclusion_threshold(q: float) -> int:
    """T with T / 2^64 the float q rounded *down* to a multiple of 2^-64: an example is included when its
    uniform 64-bit draw is below T, so the realised rate is q exactly when q >= 2^-11 and never above q
    (a lower rate is more private than the accountant assumes)."""
    return int(Fraction(q) * (1 << 64))


def poisson_indices(key: SecretKey, purpose: int, step: int, n: int, q: float) -> Tensor:
    """Indices i in [0, n) included independently with probability q (``inclusion_threshold``)."""
    t = inclusion_threshold(q)
    if t >= 1 << 64:
        return torch.arange(n)
    u = uint64s(key, purpose, step, 0, n)
    return torch.from_numpy(np.flatnonzero(u < np.uint64(t)))


def band_labels(key: SecretKey, n: int, bands: int) -> np.ndarray:
    """Each example's class ``l_i`` in ``[0, bands)`` (int64), i.i.d. over examples and independent of
    the data: example i may join only the batches of steps t = l_i mod ``bands`` (a 64-bit uniform
    reduced mod ``bands``: the classes' probabilities differ from 1/bands by under 2^-58, which the
    guarantee does not read: it holds for any fixed class of each example)."""
    return (uint64s(key, Purpose.BAND, 0, 0, n) % np.uint64(bands)).astype(np.int64)


def normals(key: SecretKey, purpose: int, step: int, index: int, count: int,
            device: torch.device | str = "cpu", cipher: str = "auto", out: Tensor | None = None) -> Tensor:
    """``count`` independent standard normals (float64) at the address, on ``device``. ``cipher``:
    where the keystream is made: ``"openssl"`` (on the CPU), ``"torch"`` (on ``device``) or ``"auto"``
    (torch for large draws on a GPU); the numbers are the same either way. ``out``: written into this
    float64 vector of ``count`` on ``device`` (a buffer reused from draw to draw) and returned."""
    if out is None:
        out = torch.empty(count, dtype=torch.float64, device=device)
    elif out.shape != (count,) or out.dtype != torch.float64 or out.device != torch.device(device):
        raise ValueError(f"normals: out must be float64 [{count}] on {device}, got {out.dtype} {list(out.shape)} "
                         f"on {out.device}")
    for start, z in normal_chunks(key, purpose, step, index, count, device, cipher):
        out[start:start + len(z)] = z
    return out


def normal_chunks(key: SecretKey, purpose: int, step: int, index: int, count: int,
                  device: torch.device | str = "cpu", cipher: str = "auto") -> Iterator[tuple[int, Tensor]]:
    """The normals of ``normals`` as ``(start, values)`` pieces (bounded memory: a caller can use each
    piece while it is in cache): 2^21 normals, or on the torch keystream path as many whole chunks of
    2^21 as one call of ``chacha20_words`` makes (``_TORCH_BLOCKS``: its cost is mostly ~600 kernel
    launches per call on a GPU, whatever the size)."""
    device = torch.device(device)
    if cipher not in ("auto", "openssl", "torch"):
        raise ValueError(f"cipher must be auto, openssl or torch, got {cipher!r}")
    address, pairs = nonce(purpose, step, index), math.ceil(count / 2)
    per_call = max(1, _TORCH_BLOCKS // (3 * _CHUNK_PAIRS * 8 // BLOCK_BYTES))  # whole chunks per call
    chunk = 0
    while chunk * _CHUNK_PAIRS < pairs:
        first = chunk * _CHUNK_PAIRS
        m = min(_CHUNK_PAIRS, pairs - first)
        if cipher == "torch" or (cipher == "auto" and _on_device(device, m)):
            whole = min(per_call, (pairs - first) // _CHUNK_PAIRS)
            z = box_muller(_pair_words(key, address, chunk, whole, device) if whole else
                           _pair_words_part(key, address, chunk, m, device))
            chunk += max(whole, 1)
        else:
            z = _normals_of(_stream_runs(key, address, chunk, m), device)
            chunk += 1
        yield 2 * first, z[:count - 2 * first]


def _on_device(device: torch.device, pairs: int) -> bool:
    """Whether ``auto`` makes the keystream of ``pairs`` pairs on ``device`` rather than by OpenSSL on
    the host. On an H200 (16-core Xeon host) OpenSSL's normals took 0.56 ms for 13k pairs and 3.0 ms
    for 136k, the Triton kernel's about 1.1 ms for either (crossover near 40k pairs), the torch
    kernel's 20 ms (its launches): the device from 2^16 pairs with Triton, 2^18 without."""
    if device.type == "cpu":
        return False
    return pairs >= (_TRITON_KEYSTREAM_PAIRS if device.type == "cuda" and triton_kernel() is not None
                     else _GPU_KEYSTREAM_PAIRS)


def _stream_runs(key: SecretKey, address: bytes, chunk: int, pairs: int, out: np.ndarray | None = None,
                 first: int = 0) -> np.ndarray:
    """The 64-bit integers H, L, A of pairs ``first .. first + pairs`` of chunk ``chunk`` of the address, by
    OpenSSL, as ``[3, pairs]`` uint64 (written into ``out`` when given: rows contiguous); ``first`` a multiple
    of 8 (a keystream block holds 8 integers).

    Stream layout: chunk c (pairs ``c * _CHUNK_PAIRS ...``) occupies ``PAIR_BYTES * _CHUNK_PAIRS`` bytes,
    its H integers first, then its L, then its A (little-endian), so that pair i is the same whatever
    the number of normals asked for."""
    if first % (BLOCK_BYTES // 8) or first + pairs > _CHUNK_PAIRS:
        raise ValueError(f"_stream_runs: pairs {first} .. {first + pairs} are not block-aligned pairs of one chunk")
    out = np.empty((3, pairs), dtype="<u8") if out is None else out
    for part in range(3):
        keystream(key.bytes, address, 8 * pairs, (8 * (3 * chunk + part) * _CHUNK_PAIRS + 8 * first) // BLOCK_BYTES,
                  out=out[part])
    return out


def _normals_of(runs: np.ndarray, device: torch.device) -> Tensor:
    """Box-Muller of the pairs of ``runs`` (``[3, ...]`` uint64: H, L, A, any trailing shape, flattened
    in C order) on ``device``. L is converted only where H < 2^54 (about one pair in a thousand) and the
    complements ~H, ~L only where ``box_muller`` reads them (about one pair in a million): ``_box_muller``."""
    h, l, a = (runs[i].reshape(-1) for i in range(3))

    def low(at: Tensor) -> Tensor:
        return torch.from_numpy(_float64(l[at.cpu().numpy()])).to(device)

    def complements(near_one: Tensor) -> tuple[Tensor, Tensor]:
        at = near_one.nonzero().squeeze(1).cpu().numpy()
        return tuple(torch.from_numpy(np.invert(v[at]).astype(np.float64)).to(device) for v in (h, l))

    return _box_muller(torch.from_numpy(_float64(h)).to(device), low, torch.from_numpy(_float64(a)).to(device),
                       complements)


def _float64(v: np.ndarray) -> np.ndarray:
    """uint64 -> float64 with one rounding, the value of ``v.astype(np.float64)``: from the 32-bit
    halves, hi 2^32 and lo are exact and their sum is rounded once (numpy's uint64 cast is about
    3x slower: 3.7 against 1.2 ns a number)."""
    w = v.view("<u4").reshape(-1, 2)  # low word first
    f = w[:, 1].astype(np.float64)
    f *= _T32
    f += w[:, 0].astype(np.float64)
    return f


def _pair_words(key: SecretKey, address: bytes, chunk: int, chunks: int, device: torch.device) -> tuple[Tensor, ...]:
    """What ``_stream_runs`` holds for ``chunks`` whole chunks from ``chunk`` on, made by one call of
    ``chacha20_words`` on ``device`` (whole chunks lie back to back in the stream: chunk c's H, L, A,
    then chunk c + 1's), as the five float64 vectors of ``box_muller``."""
    per_part = 8 * _CHUNK_PAIRS // BLOCK_BYTES
    w = chacha20_words(key.bytes, address, 3 * chunks * per_part, 3 * chunk * per_part, device)
    return _float_words(w.view(chunks, 3, _CHUNK_PAIRS, 2).unbind(1))


def _pair_words_part(key: SecretKey, address: bytes, chunk: int, pairs: int, device: torch.device) -> tuple[Tensor, ...]:
    """``_pair_words`` of the first ``pairs`` pairs of one (last, partial) chunk: its H, L, A runs
    are not adjacent in the stream, one call each."""
    per_part = 8 * _CHUNK_PAIRS // BLOCK_BYTES
    return _float_words([chacha20_words(key.bytes, address, -(-8 * pairs // BLOCK_BYTES), (3 * chunk + part) * per_part,
                                        device)[:2 * pairs].view(pairs, 2) for part in range(3)])


def _float_words(runs) -> tuple[Tensor, ...]:
    """H, L, A (each ``[..., 2]`` 32-bit words, low word first) -> H, L, A, ~H, ~L as float64 vectors,
    each the exact 64-bit integer rounded once."""
    out = []
    for part, w in enumerate(runs):
        w = w.reshape(-1, 2).to(torch.float64)
        out.append(w[:, 1] * _T32 + w[:, 0])
        if part < 2:
            out.append((_M32 - w[:, 1]) * _T32 + (_M32 - w[:, 0]))  # the complement, likewise
    h, hc, l, lc, a = out
    return h, l, a, hc, lc


def box_muller(w) -> Tensor:
    """Two standard normals per pair, interleaved (cos, sin), from the five float64 vectors ``w`` =
    (H, L, A, ~H, ~L) of ``_pair_words``: radius from the 128-bit integer U = H 2^64 + L, angle from A.

    u = (U + 1/2) / 2^128 lies in [2^-129, 1 - 2^-129]; ln u is log(u), except above 1 - 2^-20, where
    log1p(-v) with v = 1 - u = (~U + 1/2) / 2^128 keeps the relative precision (2^-52) of a small
    radius: sqrt(-2 ln u) is accurate to a few ulp everywhere, near 0 as in the tails (u down to
    2^-129: 13.37); theta = 2 pi (A + 1/2) / 2^64."""
    h, l, a, hc, lc = w
    return _box_muller(h, lambda at: l[at], a, lambda near_one: (hc[near_one], lc[near_one]))


def _box_muller(h: Tensor, low, a: Tensor, complements) -> Tensor:
    """``box_muller`` with L asked for only where H < 2^54 (``low(indices)``, about one pair in a
    thousand) and ~H, ~L only where u > 1 - 2^-20 (``complements(mask)``).

    Why L is read only there: u is the float64 value of ``(H + (L + 1/2) 2^-64) 2^-64``, in which the
    added term lies in (0, 1]. Where H's float64 is at least 2^54 its ulp is at least 4, so adding at
    most 1 rounds back to it exactly, and u = H 2^-64 (a power-of-two scaling, exact): the same bits as the whole
    expression, which is still evaluated as written wherever H < 2^54."""
    u = h * _T64
    few = (h < 2.0 ** 54).nonzero().squeeze(1)
    if len(few):
        u[few] = (h[few] + (low(few) + 0.5) * _T64) * _T64
    lg = torch.log(u)
    near_one = u > 1.0 - 2.0 ** -20
    if bool(near_one.any()):  # about one pair in a million
        hc, lc = complements(near_one)
        v = (hc + (lc + 0.5) * _T64) * _T64
        lg[near_one] = torch.log1p(-v)
    r = torch.sqrt(lg.mul_(-2.0))
    theta = (a + 0.5).mul_(2.0 * math.pi * _T64)
    out = torch.empty(len(r), 2, dtype=torch.float64, device=r.device)
    torch.mul(r, torch.cos(theta), out=out[:, 0])
    torch.mul(r, torch.sin(theta), out=out[:, 1])
    return out.view(-1)


def keyed_ints(key: SecretKey, purpose: int, step: int, keys: Iterable[int], count: int, high: int) -> Tensor:
    """``[len(keys), count]`` integers in ``[0, high)``, row i a pure function of ``keys[i]`` (a 64-bit
    uniform reduced mod ``high``: bias below high / 2^64)."""
    rows = [uint64s(key, purpose, step, int(k), count) % np.uint64(high) for k in keys]
    if not rows:
        return torch.zeros(0, count, dtype=torch.long)
    return torch.from_numpy(np.stack(rows).astype(np.int64))


def keyed_normal(key: SecretKey, purpose: int, step: int, keys: Iterable[int], d: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Tensor:
    """``[len(keys), d]`` standard normal rows, row i a pure function of ``keys[i]``: row i is
    ``normals(key, purpose, step, keys[i], d, device)`` in ``dtype``.

    Rows of at most one chunk whose keystream comes from OpenSSL (every row on the CPU) are made
    about 2^20 pairs at a time: the keystream of each row into one buffer, then one Box-Muller over
    all of them (elementwise, so the same numbers as row by row, with a few large operations instead
    of a dozen small ones per row)."""
    keys, device = [int(k) for k in keys], torch.device(device)
    out = torch.empty(len(keys), d, device=device, dtype=dtype)
    pairs = -(-d // 2)
    if not keys or d == 0:
        return out
    if pairs > _CHUNK_PAIRS or _on_device(device, pairs):
        for i, k in enumerate(keys):
            out[i] = normals(key, purpose, step, k, d, device)
        return out
    rows = max(1, _CHUNK_PAIRS // pairs)
    for first in range(0, len(keys), rows):
        block = keys[first:first + rows]
        runs = np.empty((3, len(block), pairs), dtype="<u8")
        for j, k in enumerate(block):
            _stream_runs(key, nonce(purpose, step, k), 0, pairs, out=runs[:, j])
        out[first:first + len(block)] = _normals_of(runs, device).view(len(block), 2 * pairs)[:, :d]
    return out


def int_list(ids: Tensor | Iterable[int]) -> list[int]:
    """``[int(i) for i in ids]``, from a tensor in one ``tolist`` (iterating a tensor of 10,000 ids
    elementwise takes 6 ms, 61x longer)."""
    if isinstance(ids, Tensor):
        return ids.tolist() if not ids.is_floating_point() and ids.dtype != torch.bool else [int(i) for i in ids.tolist()]
    return [int(i) for i in ids]


def batch_keys(indices: Tensor | None, start: int, size: int) -> list[int]:
    """Example indices of ``[start, start + size)`` of the logical batch, or the positions."""
    if indices is not None:
        return int_list(indices[start:start + size])
    return list(range(start, start + size))
