"""ChaCha20 keystream (RFC 8439): the only source of secret random bits in clipbias.

A secret draw is addressed by ``(purpose, step, index)`` (``clipbias.randomness.key``), which is
the cipher's 96-bit nonce; the 32-bit block counter then indexes 64-byte blocks of that stream. So
every draw is a pure function of the key and its address: no generator state to carry, exact
resume from a step counter, the same bits on every rank of a process group and on any device.

Two implementations of the same function:

* ``keystream``: OpenSSL's ChaCha20 through the ``cryptography`` package (PyCA), a few GB/s on one
  CPU core. Used for every draw on the CPU and for small draws on a GPU.
* ``chacha20_words``: the block function written in torch integer operations, so that large draws
  on a GPU are made where they are used. It is also the independent reference the tests compare
  the OpenSSL stream with (and both with the RFC 8439 test vectors).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

BLOCK_BYTES = 64
MAX_BLOCKS = 1 << 32  # the block counter is 32 bits: 256 GiB per address
_CHUNK = 1 << 22      # keystream is produced in 4 MiB pieces (bounded temporary memory)
_ZEROS = bytes(_CHUNK)


def keystream(key: bytes, nonce: bytes, nbytes: int, counter: int = 0, out: np.ndarray | None = None) -> np.ndarray:
    """``nbytes`` bytes of the ChaCha20 keystream of (key, nonce) from block ``counter``, as uint8
    (written into ``out``, a contiguous array of ``nbytes`` bytes, when given)."""
    _check(key, nonce, nbytes, counter)
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
    if out is None:
        out = np.empty(nbytes, dtype=np.uint8)
    else:
        if not out.flags.c_contiguous or out.nbytes != nbytes:
            raise ValueError(f"keystream: out must be a contiguous array of {nbytes} bytes, got {out.nbytes} bytes "
                             f"(contiguous: {out.flags.c_contiguous})")
        out = out.reshape(-1).view(np.uint8)
    # cryptography's ChaCha20 nonce is OpenSSL's 16-byte IV: the 32-bit little-endian block counter,
    # then RFC 8439's 96-bit nonce
    enc = Cipher(algorithms.ChaCha20(key, counter.to_bytes(4, "little") + nonce), mode=None).encryptor()
    view, zeros = memoryview(out), memoryview(_ZEROS)
    for start in range(0, nbytes, _CHUNK):  # encrypting zeros yields the keystream itself
        m = min(_CHUNK, nbytes - start)
        enc.update_into(zeros[:m], view[start:start + m])
    return out


def _check(key: bytes, nonce: bytes, nbytes: int, counter: int) -> None:
    if len(key) != 32 or len(nonce) != 12:
        raise ValueError(f"ChaCha20 takes a 32-byte key and a 12-byte nonce, got {len(key)} and {len(nonce)}")
    if nbytes < 0 or counter < 0 or counter + -(-nbytes // BLOCK_BYTES) > MAX_BLOCKS:
        raise ValueError(f"a ChaCha20 stream holds {MAX_BLOCKS} blocks of 64 bytes; asked for {nbytes} bytes "
                         f"from block {counter}")


_M32 = 0xFFFFFFFF
_SIGMA = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)  # "expand 32-byte k"
# the quarter rounds of a double round act on columns, then on diagonals: rows of the 4x4 state
_COLUMNS = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]])
_DIAGONALS = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 4], [10, 11, 8, 9], [15, 12, 13, 14]])


def _rotl(x: Tensor, n: int) -> Tensor:
    return ((x << n) | (x >> (32 - n))) & _M32


def _quarter_rounds(x: Tensor, rows: Tensor) -> None:
    """Four quarter rounds at once on the rows ``rows`` of the state ``x [16, blocks]`` (int64 words)."""
    a, b, c, d = (x[r] for r in rows)
    a = (a + b) & _M32
    d = _rotl(d ^ a, 16)
    c = (c + d) & _M32
    b = _rotl(b ^ c, 12)
    a = (a + b) & _M32
    d = _rotl(d ^ a, 8)
    c = (c + d) & _M32
    b = _rotl(b ^ c, 7)
    for r, v in zip(rows, (a, b, c, d)):
        x[r] = v


def chacha20_words(key: bytes, nonce: bytes, blocks: int, counter: int = 0,
                   device: torch.device | str = "cpu") -> Tensor:
    """The same keystream as ``keystream`` as 32-bit words ``[blocks * 16]`` (int64 holding values in
    [0, 2^32), little-endian word order), computed on ``device`` with torch integer operations."""
    _check(key, nonce, blocks * BLOCK_BYTES, counter)
    kw = [int.from_bytes(key[i:i + 4], "little") for i in range(0, 32, 4)]
    nw = [int.from_bytes(nonce[i:i + 4], "little") for i in range(0, 12, 4)]
    init = torch.tensor([*_SIGMA, *kw, 0, *nw], dtype=torch.int64, device=device)
    state = init.unsqueeze(1).repeat(1, blocks)
    state[12] = counter + torch.arange(blocks, dtype=torch.int64, device=device)
    x = state.clone()
    cols, diags = _COLUMNS.to(device), _DIAGONALS.to(device)
    for _ in range(10):  # 20 rounds
        _quarter_rounds(x, cols)
        _quarter_rounds(x, diags)
    return ((x + state) & _M32).t().reshape(-1)


def words_of(stream: np.ndarray) -> np.ndarray:
    """Little-endian 32-bit words of a keystream (uint32)."""
    return stream.view("<u4")
