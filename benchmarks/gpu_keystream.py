"""The secret noise on a GPU, by keystream source (needs a CUDA device).

    python benchmarks/gpu_keystream.py            # ~20 s on an H200

Best of 3-5 synchronised calls (after one warm-up, which compiles the Triton kernel): the
ChaCha20 keystream of 2^20 blocks (64 MiB) by the Triton kernel and by the torch one, then
``normals(key, Purpose.NOISE, 1, 0, n, "cuda", cipher=...)`` for the cnn's, resnet20-gn's, 2^21 and
the 64M GPT's numbers of parameters, with the keystream from OpenSSL on the host, the Triton kernel,
and the torch kernel. All three give the same numbers (tests/test_cuda.py).
"""

from __future__ import annotations

import time

import torch

import clipbias.randomness.chacha as chacha
from clipbias.randomness import Purpose, SecretKey, normals

SIZES = (26010, 272474, 1 << 21, 64106496)


def best_ms(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("gpu_keystream.py needs a CUDA device")
    dev, key = torch.device("cuda"), SecretKey.generate()
    if chacha.triton_kernel() is None:
        raise SystemExit("Triton is not installed: nothing to compare")
    print(torch.cuda.get_device_name(), torch.__version__)
    for kernel in ("triton", "torch"):
        ms = best_ms(lambda: chacha.chacha20_words(bytes(32), bytes(12), 1 << 20, 0, dev, kernel=kernel))
        print(f"keystream, 2^20 blocks, {kernel} kernel: {ms:.2f} ms")
    found = chacha.triton_kernel
    for n in SIZES:
        reps = 3 if n > 10 ** 7 else 5
        row = {"openssl": best_ms(lambda: normals(key, Purpose.NOISE, 1, 0, n, dev, cipher="openssl"), reps),
               "triton": best_ms(lambda: normals(key, Purpose.NOISE, 1, 0, n, dev, cipher="torch"), reps)}
        chacha.triton_kernel = lambda: None  # the torch kernel
        try:
            row["torch"] = best_ms(lambda: normals(key, Purpose.NOISE, 1, 0, n, dev, cipher="torch"), reps)
        finally:
            chacha.triton_kernel = found
        print(f"normals n = {n}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in row.items()))


if __name__ == "__main__":
    main()
