"""ChaCha20 keystream (RFC 8439): the only source of secret random bits in clipbias.

A secret draw is addressed by ``(purpose, step, index)`` (``clipbias.randomness.key``), which is
the cipher's 96-bit nonce; the 32-bit block counter then indexes 64-byte blocks of that stream. So
every draw is a pure function of the key and its address: no generator state to carry, exact
resume from a step counter, the same bits on every rank of a process group and on any device.

Two implementations of the same function:

* ``keystream``: OpenSSL's ChaCha20 through the ``cryptography`` package (PyCA), a few GB/s on one
  CPU core. Used for every draw on the CPU and for small draws on a GPU.
* ``chacha20_words``: the block function on a torch device, so that large draws on a GPU are made
  where they are used: one Triton kernel on CUDA (``chacha_triton``), or torch integer operations
  anywhere. The torch version is also the independent reference the tests compare the OpenSSL
  stream with (and all of them with the RFC 8439 test vectors).
"""

from __future__ import annotations

import functools

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


def _signed(w: int) -> int:
    """A 32-bit word as the int32 with the same bits."""
    return w - (1 << 32) if w >= 1 << 31 else w


def _rotl_(x: Tensor, n: int, spill: Tensor) -> None:
    """``x <<<= n`` on 32-bit words held in int32 (two's complement: additions wrap, ``<<`` drops the
    high bits; ``>>`` copies the sign bit, which the mask removes), in place; ``spill``: scratch."""
    torch.bitwise_right_shift(x, 32 - n, out=spill).bitwise_and_((1 << n) - 1)
    x.bitwise_left_shift_(n).bitwise_or_(spill)


def _quarter_rounds(a: Tensor, b: Tensor, c: Tensor, d: Tensor, spill: Tensor) -> None:
    """Four quarter rounds at once, in place: word j of rows a, b, c, d (``[4, blocks]`` views of the
    state) is one quarter round's (a, b, c, d), for every block (RFC 8439, 2.1)."""
    for x, y, z, n in ((a, b, d, 16), (c, d, b, 12), (a, b, d, 8), (c, d, b, 7)):  # x += y; z ^= x; z <<<= n
        x.add_(y)
        z.bitwise_xor_(x)
        _rotl_(z, n, spill)


def chacha20_words(key: bytes, nonce: bytes, blocks: int, counter: int = 0,
                   device: torch.device | str = "cpu", kernel: str = "auto") -> Tensor:
    """The same keystream as ``keystream`` as 32-bit words ``[blocks * 16]`` (int64 holding values in
    [0, 2^32), little-endian word order), computed on ``device``: by the Triton kernel of
    ``chacha_triton`` on a CUDA device where Triton is installed (``kernel="auto"`` or ``"triton"``),
    else (or with ``kernel="torch"``) with torch integer operations.

    Torch version: the state is ``[4, 4, blocks]`` int32: its rows are the quarter rounds' a, b, c, d for the four
    columns, so a column round is 24 in-place operations on ``[4, blocks]`` views, and a diagonal
    round the same after rotating rows b, c, d by 1, 2, 3 words (and back): ~600 kernel launches per
    call whatever ``blocks`` (on a GPU the cost is launches and memory traffic, hence int32)."""
    _check(key, nonce, blocks * BLOCK_BYTES, counter)
    if kernel not in ("auto", "torch", "triton"):
        raise ValueError(f"kernel must be auto, torch or triton, got {kernel!r}")
    kw = [int.from_bytes(key[i:i + 4], "little") for i in range(0, 32, 4)]
    nw = [int.from_bytes(nonce[i:i + 4], "little") for i in range(0, 12, 4)]
    init = torch.tensor([_signed(w) for w in (*_SIGMA, *kw, 0, *nw)], dtype=torch.int32, device=device)
    triton_words = triton_kernel() if kernel == "triton" or (kernel == "auto" and init.device.type == "cuda") else None
    if kernel == "triton" and triton_words is None:
        raise RuntimeError("kernel='triton' needs the triton package (it comes with CUDA builds of torch)")
    if triton_words is not None:
        return triton_words(init, counter, blocks).to(torch.int64).bitwise_and_(_M32)
    state = init.view(4, 4, 1).repeat(1, 1, blocks)
    ctr = counter + torch.arange(blocks, dtype=torch.int64, device=device)  # < 2^32 (``_check``)
    state[3, 0] = torch.where(ctr >= 1 << 31, ctr - (1 << 32), ctr).to(torch.int32)
    x = state.clone()
    a, b, c, d = x.unbind(0)
    spill = torch.empty_like(a)
    for _ in range(10):  # 20 rounds: a column round, then a diagonal round
        _quarter_rounds(a, b, c, d, spill)
        for row, k in ((b, 1), (c, 2), (d, 3)):
            row.copy_(row.roll(-k, 0))
        _quarter_rounds(a, b, c, d, spill)
        for row, k in ((b, 1), (c, 2), (d, 3)):
            row.copy_(row.roll(k, 0))
    return x.add_(state).view(16, blocks).t().reshape(-1).to(torch.int64).bitwise_and_(_M32)


@functools.lru_cache(maxsize=None)
def triton_kernel():
    """``chacha_triton.keystream_words``, or None where Triton is not installed."""
    try:
        from .chacha_triton import keystream_words
    except ImportError:
        return None
    return keystream_words


def words_of(stream: np.ndarray) -> np.ndarray:
    """Little-endian 32-bit words of a keystream (uint32)."""
    return stream.view("<u4")
