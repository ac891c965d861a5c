"""The ChaCha20 block function as one Triton kernel: the GPU keystream of ``chacha20_words``.

The torch version in ``chacha`` runs each of the 20 rounds' additions, XORs and rotations as its
own kernel over all blocks (~600 launches and as many passes over memory per call): on an H200
the 64M-coordinate noise of the GPT benchmark spent ~100 ms a step there. Here each GPU thread keeps
whole blocks' 16-word states in registers and writes only the keystream, so the cost is the
memory write. The output is bit-identical to the torch version and to OpenSSL (RFC 8439): the
CUDA tests compare all three, including the block counter near 2^32.

Imported only where a CUDA device makes keystream (``chacha.chacha20_words``); where Triton is
missing the torch version runs instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCKS_PER_PROGRAM = 256


@triton.jit
def _quarter(a, b, c, d):
    """One quarter round (RFC 8439, 2.1) on uint32 words: additions wrap, shifts are logical."""
    a = a + b
    d = d ^ a
    d = (d << 16) | (d >> 16)
    c = c + d
    b = b ^ c
    b = (b << 12) | (b >> 20)
    a = a + b
    d = d ^ a
    d = (d << 8) | (d >> 24)
    c = c + d
    b = b ^ c
    b = (b << 7) | (b >> 25)
    return a, b, c, d


@triton.jit
def _word(init_ptr, j, zeros):
    return tl.load(init_ptr + j).to(tl.uint32, bitcast=True) + zeros


@triton.jit
def _store(out, j, x, s, mask):
    tl.store(out + j, (x + s).to(tl.int32, bitcast=True), mask=mask)


@triton.jit
def _blocks(init_ptr, out_ptr, counter, blocks, PER: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * PER + tl.arange(0, PER)
    mask = i < blocks
    z = tl.zeros([PER], dtype=tl.uint32)
    s0, s1, s2, s3 = _word(init_ptr, 0, z), _word(init_ptr, 1, z), _word(init_ptr, 2, z), _word(init_ptr, 3, z)
    s4, s5, s6, s7 = _word(init_ptr, 4, z), _word(init_ptr, 5, z), _word(init_ptr, 6, z), _word(init_ptr, 7, z)
    s8, s9, s10, s11 = _word(init_ptr, 8, z), _word(init_ptr, 9, z), _word(init_ptr, 10, z), _word(init_ptr, 11, z)
    s12 = (i + counter).to(tl.uint32)  # the block counter (< 2^32: checked by the caller)
    s13, s14, s15 = _word(init_ptr, 13, z), _word(init_ptr, 14, z), _word(init_ptr, 15, z)
    x0, x1, x2, x3, x4, x5, x6, x7 = s0, s1, s2, s3, s4, s5, s6, s7
    x8, x9, x10, x11, x12, x13, x14, x15 = s8, s9, s10, s11, s12, s13, s14, s15
    for _ in range(10):  # 20 rounds: a column round, then a diagonal round
        x0, x4, x8, x12 = _quarter(x0, x4, x8, x12)
        x1, x5, x9, x13 = _quarter(x1, x5, x9, x13)
        x2, x6, x10, x14 = _quarter(x2, x6, x10, x14)
        x3, x7, x11, x15 = _quarter(x3, x7, x11, x15)
        x0, x5, x10, x15 = _quarter(x0, x5, x10, x15)
        x1, x6, x11, x12 = _quarter(x1, x6, x11, x12)
        x2, x7, x8, x13 = _quarter(x2, x7, x8, x13)
        x3, x4, x9, x14 = _quarter(x3, x4, x9, x14)
    o = out_ptr + i * 16
    _store(o, 0, x0, s0, mask)
    _store(o, 1, x1, s1, mask)
    _store(o, 2, x2, s2, mask)
    _store(o, 3, x3, s3, mask)
    _store(o, 4, x4, s4, mask)
    _store(o, 5, x5, s5, mask)
    _store(o, 6, x6, s6, mask)
    _store(o, 7, x7, s7, mask)
    _store(o, 8, x8, s8, mask)
    _store(o, 9, x9, s9, mask)
    _store(o, 10, x10, s10, mask)
    _store(o, 11, x11, s11, mask)
    _store(o, 12, x12, s12, mask)
    _store(o, 13, x13, s13, mask)
    _store(o, 14, x14, s14, mask)
    _store(o, 15, x15, s15, mask)


def keystream_words(init: Tensor, counter: int, blocks: int) -> Tensor:
    """``blocks`` keystream blocks from block ``counter`` as int32 words ``[blocks * 16]`` (the bits of
    the little-endian 32-bit words), on ``init``'s device. ``init``: the 16 int32 words of the
    initial state (constants, key, a counter word this kernel replaces, nonce)."""
    out = torch.empty(blocks * 16, dtype=torch.int32, device=init.device)
    if blocks:
        _blocks[(triton.cdiv(blocks, _BLOCKS_PER_PROGRAM),)](init, out, counter, blocks, PER=_BLOCKS_PER_PROGRAM)
    return out
