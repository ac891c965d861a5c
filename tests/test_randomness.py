"""Secret randomness (clipbias.randomness): ChaCha20 against RFC 8439 and an independent
implementation, the Gaussian sampler's distribution, the exact rounding of the release, the keyed
draws, and the attack the design closes (a seed small enough to enumerate is recovered from the
released weights, and with it the exact clipped sum)."""

from __future__ import annotations

import ast
import math
import pathlib
from fractions import Fraction

import numpy as np
import pytest
import torch
from scipy import stats

from clipbias.config import AlgoConfig
from clipbias.engine.core import DPEngine
from clipbias.errors import ConfigError
from clipbias.randomness import (Purpose, SecretKey, keyed_ints, noise_grid, normals, poisson_indices, snap,
                                 snapped_gaussian)
from clipbias.randomness.chacha import chacha20_words, keystream, words_of

KEY = SecretKey.from_seed(2024)


# ------------------------------------------------------------------ the cipher
def test_chacha20_matches_rfc8439_test_vectors():
    """RFC 8439 2.3.2 (block function, counter 1) and 2.4.2 (keystream of the sunscreen example)."""
    key, nonce = bytes(range(32)), bytes.fromhex("000000090000004a00000000")
    block = "10f1e7e4d13b5915500fdd1fa32071c4c7d1f4c733c068030422aa9ac3d46c4ed2826446079faa0914c2d705d98b02a2b5129cd1de164eb9cbd083e8a2503c4e"
    assert keystream(key, nonce, 64, counter=1).tobytes().hex() == block
    words = chacha20_words(key, nonce, 1, counter=1).numpy().astype("<u4")
    assert words.tobytes().hex() == block
    nonce2 = bytes.fromhex("000000000000004a00000000")
    plain = (b"Ladies and Gentlemen of the class of '99: If I could offer you only one tip for the future, "
             b"sunscreen would be it.")
    cipher = bytes(a ^ b for a, b in zip(plain, keystream(key, nonce2, len(plain), counter=1).tobytes()))
    assert cipher[:16].hex() == "6e2e359a2568f98041ba0728dd0d6981"
    assert len(cipher) == 114 and cipher[-18:].hex() == "5af90bbf74a35be6b40b8eedf2785e42874d"


def test_openssl_and_torch_keystreams_agree():
    """The two implementations (OpenSSL through cryptography; torch integer ops, the GPU path) give
    the same words for any key, nonce and starting block."""
    g = np.random.default_rng(0)  # test inputs only
    cases = [(g.bytes(32), g.bytes(12), b, c) for b, c in ((1, 0), (37, 5), (300, (1 << 32) - 300))]
    cases.append((b"\xff" * 32, b"\xff" * 12, 40, (1 << 31) - 20))  # every word's top bit set (int32 state)
    for key, nonce, blocks, counter in cases:
        a = words_of(keystream(key, nonce, 64 * blocks, counter)).astype(np.int64)
        assert np.array_equal(a, chacha20_words(key, nonce, blocks, counter).numpy())
    with pytest.raises(ValueError, match="blocks"):
        keystream(bytes(32), bytes(12), 128, counter=(1 << 32) - 1)


# ------------------------------------------------------------------ normals
@pytest.fixture(scope="module")
def million():
    return normals(KEY, Purpose.NOISE, 0, 0, 10 ** 6).numpy()


def test_normals_match_n01_in_moments_and_shape(million):
    z = million
    n = len(z)
    assert abs(z.mean()) < 5 / math.sqrt(n) and abs(z.var() - 1) < 5 * math.sqrt(2 / n)
    assert abs(stats.kurtosis(z, fisher=False) - 3) < 5 * math.sqrt(24 / n)
    assert abs(stats.skew(z)) < 5 * math.sqrt(6 / n)
    assert stats.kstest(z, "norm").pvalue > 1e-3
    # tail frequencies: beyond 3 and 4 sigma within 5 standard errors of the normal's
    for t in (3.0, 4.0):
        p = 2 * stats.norm.sf(t)
        assert abs((np.abs(z) > t).sum() - n * p) < 5 * math.sqrt(n * p)


def test_normals_reach_beyond_five_sigma():
    """The 128-bit radius reaches 13.37 sigma; in 10^7 draws about 5.7 lie beyond 5 sigma (a sampler
    built on float32 or 24-bit uniforms truncates near 5.5-5.8 sigma)."""
    z = normals(KEY, Purpose.NOISE, 1, 0, 10 ** 7)
    beyond = int((z.abs() > 5).sum())
    assert beyond >= 1
    assert beyond < 5.7 + 6 * math.sqrt(5.7)


def test_draws_are_pure_functions_of_key_and_address(million):
    again = normals(KEY, Purpose.NOISE, 0, 0, 1000).numpy()
    assert np.array_equal(again, million[:1000])  # a prefix: the count does not change the draws
    others = [normals(KEY, Purpose.PERTURB, 0, 0, 1000), normals(KEY, Purpose.NOISE, 1, 0, 1000),
              normals(KEY, Purpose.NOISE, 0, 1, 1000), normals(SecretKey.from_seed(2025), Purpose.NOISE, 0, 0, 1000)]
    for o in others:  # independent across purposes, steps, indices and keys
        assert abs(np.corrcoef(again, o.numpy())[0, 1]) < 5 / math.sqrt(1000)
    assert np.array_equal(normals(KEY, Purpose.NOISE, 7, 0, 3 << 20)[2 ** 21:2 ** 21 + 10].numpy(),
                          normals(KEY, Purpose.NOISE, 7, 0, (3 << 20) - 5)[2 ** 21:2 ** 21 + 10].numpy())


def test_box_muller_is_accurate_to_2_to_the_minus_44_against_200_bit_arithmetic():
    """The float64 normals equal the exact Box-Muller of the same 192 bits (mpmath, 200-bit precision)
    to 2^-44 absolute, in the bulk, near 0 (u near 1: the complement path) and in the far tail (u near
    2^-128): the error bound of the floating-point argument in docs/privacy.md."""
    import mpmath
    from clipbias.randomness.draws import box_muller
    mpmath.mp.prec = 200
    g = np.random.default_rng(1)  # test inputs
    n = 3000
    h, l, a = (g.integers(0, 2 ** 64, n, dtype=np.uint64) for _ in range(3))
    h[:300] = 0  # far tail (radius up to 13.37)
    l[:150] = g.integers(0, 2 ** 20, 150, dtype=np.uint64)
    h[300:600] = np.uint64(2 ** 64 - 1) - g.integers(0, 2 ** 20, 300, dtype=np.uint64)  # radius near 0
    a[600:900] = (np.arange(300, dtype=np.uint64) % 4) * np.uint64(2 ** 62) + g.integers(0, 2 ** 20, 300,
                                                                                           dtype=np.uint64)
    # just below and above the switch to log1p at u = 1 - 2^-20, where log(u)'s error is largest
    h[900:1000] = np.uint64(2 ** 64 - 2 ** 44) - g.integers(0, 2 ** 36, 100, dtype=np.uint64)
    h[1000:1100] = np.uint64(2 ** 64 - 2 ** 44) + g.integers(0, 2 ** 36, 100, dtype=np.uint64)
    w = torch.from_numpy(np.stack([v.astype(np.float64) for v in (h, l, a, ~h, ~l)]))
    z = box_muller(w).view(n, 2).numpy()
    worst = 0.0
    for i in range(n):
        u = (mpmath.mpf(int(h[i])) * 2 ** 64 + int(l[i]) + mpmath.mpf(0.5)) / mpmath.mpf(2) ** 128
        r, th = mpmath.sqrt(-2 * mpmath.log(u)), 2 * mpmath.pi * (int(a[i]) + mpmath.mpf(0.5)) / mpmath.mpf(2) ** 64
        worst = max(worst, abs(float(r * mpmath.cos(th) - z[i, 0])), abs(float(r * mpmath.sin(th) - z[i, 1])))
    assert worst < 2.0 ** -44 and np.abs(z).max() > 12


def test_normals_are_the_same_with_either_keystream_implementation():
    """The GPU path makes the keystream with torch integer ops on the device: the same numbers (here
    both on the CPU): two whole chunks of the stream layout made by one torch call, then a partial one."""
    from clipbias.randomness import draws
    assert draws._TORCH_BLOCKS // (3 * draws._CHUNK_PAIRS * 8 // 64) == 2  # whole chunks per torch call
    n = (1 << 22) + 10
    assert torch.equal(normals(KEY, Purpose.NOISE, 2, 0, n, cipher="openssl"),
                       normals(KEY, Purpose.NOISE, 2, 0, n, cipher="torch"))


def test_a_keystream_kernel_that_cannot_run_is_refused_by_name(monkeypatch):
    """An unknown kernel name, or Triton asked for where it is not installed, is an error that says
    which kernels exist; ``auto`` on the CPU is the torch version (OpenSSL's words)."""
    from clipbias.randomness import chacha
    key, nonce = bytes(range(32)), bytes(12)
    with pytest.raises(ValueError, match="auto, torch or triton"):
        chacha.chacha20_words(key, nonce, 1, kernel="cuda")
    monkeypatch.setattr(chacha, "triton_kernel", lambda: None)
    with pytest.raises(RuntimeError, match="needs the triton package"):
        chacha.chacha20_words(key, nonce, 1, kernel="triton")
    assert np.array_equal(chacha.chacha20_words(key, nonce, 3, 9).numpy(),
                          chacha.words_of(chacha.keystream(key, nonce, 192, 9)).astype(np.int64))


def test_keyed_normal_rows_are_the_normals_of_their_addresses():
    """``keyed_normal`` draws many rows with one Box-Muller: row i is still exactly ``normals`` at
    ``(purpose, step, keys[i])``, across its blocks of rows (2 rows a block at this d), repeated keys,
    an odd d, float32 and float64, and one row longer than a chunk (drawn by ``normals`` itself)."""
    from clipbias.randomness import keyed_normal
    d, keys = 799_999, [9, 0, 9, 5, (1 << 40) - 1]
    for dtype in (torch.float64, torch.float32):
        z = keyed_normal(KEY, Purpose.PERTURB, 3, keys, d, dtype=dtype)
        assert z.shape == (len(keys), d) and z.dtype == dtype
        for row, k in zip(z, keys):
            assert torch.equal(row, normals(KEY, Purpose.PERTURB, 3, k, d).to(dtype))
    long = (1 << 21) + 3
    assert torch.equal(keyed_normal(KEY, Purpose.PERTURB, 3, [2], long, dtype=torch.float64)[0],
                       normals(KEY, Purpose.PERTURB, 3, 2, long))
    assert keyed_normal(KEY, Purpose.PERTURB, 3, [], 7).shape == (0, 7)
    assert keyed_normal(KEY, Purpose.PERTURB, 3, [1, 2], 0).shape == (2, 0)


def test_the_fast_uint64_conversion_and_complement_path_equal_box_muller_of_numpys_conversion():
    """``_normals_of`` converts uint64 by 32-bit halves and ~H, ~L only where u > 1 - 2^-20: the same
    numbers as ``box_muller`` of numpy's conversion of all five, at the rounding edges of the
    conversion and on both sides of the switch to log1p."""
    from clipbias.randomness.draws import _float64, _normals_of, box_muller
    g = np.random.default_rng(3)  # test inputs
    edges = np.array([0, 1, 2 ** 32 - 1, 2 ** 32, 2 ** 53 - 1, 2 ** 53 + 1, 2 ** 53 + 3, 2 ** 63 - 1, 2 ** 63,
                      2 ** 63 + 2 ** 10, 2 ** 64 - 2 ** 11, 2 ** 64 - 2 ** 10, 2 ** 64 - 2 ** 10 - 1, 2 ** 64 - 1],
                     dtype=np.uint64)
    v = np.concatenate([edges, g.integers(0, 2 ** 64, 10_000, dtype=np.uint64, endpoint=False)])
    assert np.array_equal(_float64(v), v.astype(np.float64))
    n = 4000
    h, l, a = (g.integers(0, 2 ** 64, n, dtype=np.uint64) for _ in range(3))
    h[:500] = np.uint64(2 ** 64 - 1) - g.integers(0, 2 ** 20, 500, dtype=np.uint64)  # u near 1
    h[500:600] = np.uint64(2 ** 64 - 2 ** 44) + g.integers(0, 2 ** 36, 100, dtype=np.uint64)  # at the switch
    h[600:700] = np.uint64(2 ** 64 - 2 ** 44) - g.integers(0, 2 ** 36, 100, dtype=np.uint64)
    h[700:710], l[:len(edges)] = 0, edges
    want = box_muller(torch.from_numpy(np.stack([x.astype(np.float64) for x in (h, l, a, ~h, ~l)])))
    assert torch.equal(_normals_of(np.stack([h, l, a]), torch.device("cpu")), want)


def test_reading_l_only_where_h_is_below_2_to_the_54_gives_the_bits_of_the_whole_expression():
    """``_box_muller`` reads L only where H < 2^54: everywhere the same normals as the expression
    ``(H + (L + 1/2) 2^-64) 2^-64`` evaluated for every pair (written out here), at H just below and
    above 2^53 and 2^54 with L's largest values (where the added term is 1, a tie at ulp 2) and at
    random."""
    import math as m
    from clipbias.randomness.draws import _T64, box_muller
    g = np.random.default_rng(5)  # test inputs
    n = 6000
    h, l, a = (g.integers(0, 2 ** 64, n, dtype=np.uint64) for _ in range(3))
    for i, base in enumerate((2 ** 53, 2 ** 54, 2 ** 55)):
        h[1000 * i:1000 * i + 500] = np.uint64(base) - g.integers(0, 2 ** 12, 500, dtype=np.uint64)
        h[1000 * i + 500:1000 * i + 1000] = np.uint64(base) + g.integers(0, 2 ** 12, 500, dtype=np.uint64)
    l[::2] = np.uint64(2 ** 64 - 1) - g.integers(0, 2 ** 11, (n + 1) // 2, dtype=np.uint64)  # L + 1/2 -> 2^64
    w = [torch.from_numpy(x.astype(np.float64)) for x in (h, l, a, ~h, ~l)]
    u = (w[0] + (w[1] + 0.5) * _T64) * _T64
    near = u > 1.0 - 2.0 ** -20
    lg = torch.log(u)
    lg[near] = torch.log1p(-((w[3][near] + (w[4][near] + 0.5) * _T64) * _T64))
    r, th = torch.sqrt(-2.0 * lg), (w[2] + 0.5) * (2.0 * m.pi * _T64)
    want = torch.stack([r * torch.cos(th), r * torch.sin(th)], 1).reshape(-1)
    assert int((w[0] < 2.0 ** 54).sum()) > 1000 and torch.equal(box_muller(w), want)


# ------------------------------------------------------------------ the release
def test_snap_rounds_the_exact_sum_onto_the_grid():
    """round_g(x + s) of the exact real sum (computed here in rationals), ties included."""
    g = 2.0 ** -10
    x = torch.tensor([0.1, 1e6 + 0.3, -3.75, 2.0 ** -11, 0.5 * g + 2.0 ** -60, 5 * g + g / 2, 1.0], dtype=torch.float64)
    s = torch.tensor([0.2, 1e-9, 2.0 ** -40, 0.0, -2.0 ** -61, 0.0, 1e-30], dtype=torch.float64)
    out = snap(x, s, g)
    for xi, si, oi in zip(x.tolist(), s.tolist(), out.tolist()):
        exact = (Fraction(xi) + Fraction(si)) / Fraction(g)
        k = math.floor(exact + Fraction(1, 2))
        if exact + Fraction(1, 2) == k:  # an exact tie: either neighbour is a correct rounding
            assert Fraction(oi) / Fraction(g) in (k, k - 1)
        else:
            assert Fraction(oi) == k * Fraction(g)
    assert float(out[4]) == g  # x + s = g / 2 + 2^-61 (not a float64 number): above the tie, rounds up
    assert float(out[5]) == 6 * g  # 5.5 g exactly: a tie


def test_noise_grid_is_a_power_of_two_between_std_over_512_and_std_over_256():
    for std in (1e-6, 0.004, 0.3, 1.0, 7.5, 1e4):
        g = noise_grid(std)
        assert math.frexp(g)[0] == 0.5 and std / 512 < g <= std / 256


def test_snapped_gaussian_is_on_the_grid_unbiased_and_reproducible():
    x = torch.linspace(-1, 1, 200_000, dtype=torch.float64)
    std = 0.37
    y = snapped_gaussian(x, std, KEY, 3)
    g = noise_grid(std)
    assert torch.equal(y / g, torch.round(y / g))
    r = (y - x) / std
    assert abs(float(r.mean())) < 5 / math.sqrt(len(r)) and abs(float(r.var()) - 1) < 0.02
    assert torch.equal(y, snapped_gaussian(x, std, KEY, 3))
    assert not torch.equal(y, snapped_gaussian(x, std, KEY, 4))


# ------------------------------------------------------------------ keys and sampling
def test_keys_use_every_seed_bit_and_never_print():
    seeds = [0, 1 << 32, (1 << 32) + 7 * (1 << 40), 1 << 255, (1 << 256) - 1]
    keys = [SecretKey.from_seed(s) for s in seeds]
    assert len({k.bytes for k in keys}) == len(seeds)  # unlike torch's CPU generator (low 32 bits only)
    a, b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5 + (7 << 32))
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))  # why torch seeds are not used
    fresh = SecretKey.generate()
    assert not fresh.reproducible and len(fresh.bytes) == 32 and fresh != SecretKey.generate()
    assert fresh.bytes.hex() not in repr(fresh) and "secret" in repr(fresh)
    assert SecretKey.from_state(fresh.state_dict()) == fresh


def test_poisson_inclusion_never_exceeds_q():
    """The threshold rounds q 2^64 down: the realised rate is q exactly when q >= 2^-11, below it else."""
    from clipbias.randomness import inclusion_threshold
    for n in (3, 1000, 60000, 999_983, 10 ** 7):
        assert Fraction(inclusion_threshold(1 / n), 1 << 64) <= Fraction(1 / n)
    assert Fraction(inclusion_threshold(0.25), 1 << 64) == Fraction(1, 4)


def test_one_key_drives_one_engine_and_a_failed_load_changes_nothing():
    """Two engines under one OS key would draw the same noise (their difference is noise-free): refused.
    A state that fails to load (here an optimizer for another model) leaves the engine on its own key,
    counters and steps; an engine that has taken steps cannot load a state (it would replay draws)."""
    def engine(model, **kw):
        return DPEngine(model, "dpsgd", n=40, batch_size=4, steps=5, noise_multiplier=1.0,
                        config=AlgoConfig(lr=0.1, clip=1.0), **kw)
    key = SecretKey.generate()
    first = engine(torch.nn.Linear(3, 2), noise_seed=key)
    with pytest.raises(ConfigError, match="already drives another"):
        engine(torch.nn.Linear(3, 2), noise_seed=key)
    assert first.key is key
    engine(torch.nn.Linear(3, 2), noise_seed=5), engine(torch.nn.Linear(3, 2), noise_seed=5)  # seeded: uncertified
    x, y = torch.randn(40, 3), torch.arange(40) % 2
    donor = engine(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)))
    idx = donor.sampler.sample()
    donor.step(torch.randn(len(idx), 3), y[idx], idx)
    target = engine(torch.nn.Linear(3, 2))
    own = target.key
    with pytest.raises(ValueError):
        target.load_state_dict(donor.state_dict())  # same settings, another model's optimizer state
    assert target.key == own and target.steps_taken == 0 and target.sampler.drawn == 0
    assert target.pipeline.noise.key == own and target.pipeline.noise.draws == 0 and not own.reproducible
    idx = target.sampler.sample()
    target.step(x[idx], y[idx], idx)
    with pytest.raises(ConfigError, match="taken 1 step"):
        target.load_state_dict(target.state_dict())
    assert SecretKey.from_state({"key": torch.zeros(32, dtype=torch.uint8)}).reproducible  # unknown: uncertified


def test_poisson_inclusion_has_rate_q():
    n, q = 200_000, 0.01
    sizes = [len(poisson_indices(KEY, Purpose.SAMPLE, t, n, q)) for t in range(5)]
    for s in sizes:
        assert abs(s - n * q) < 5 * math.sqrt(n * q * (1 - q))
    assert len(set(map(tuple, (poisson_indices(KEY, Purpose.SAMPLE, t, 100, 0.5).tolist() for t in range(5))))) == 5


def test_keyed_ints_are_uniform():
    v = keyed_ints(KEY, Purpose.GROUP, 0, range(20_000), 1, 7).flatten()
    counts = torch.bincount(v, minlength=7).numpy()
    assert stats.chisquare(counts).pvalue > 1e-3


# ------------------------------------------------------------------ the attack
def test_an_enumerable_seed_is_recovered_from_the_weights_and_the_default_key_has_none():
    """The DP adversary knows the data but the target, the public initial weights, the algorithm and
    its settings. With a key derived from a 14-bit seed (a deliberately weak stream, as torch's 32-bit
    CPU seeds were) the released weights give the seed by correlation over all 2^14 candidates, and
    subtracting that noise gives the clipped sum exactly (to the release grid): no privacy is left. The
    default key is 256 bits from the OS CSPRNG: there is no seed to enumerate."""
    torch.manual_seed(0)  # public model initialisation
    d_in, classes, n, B, z, c = 16, 8, 64, 4.0, 1.0, 1.0
    x, y = torch.randn(n, d_in), torch.randint(0, classes, (n,))
    model = torch.nn.Linear(d_in, classes)
    w0 = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    secret = 12_345  # the weak seed the attacker does not know
    eng = DPEngine(model, "dpsgd", n=n, batch_size=B, steps=1, noise_multiplier=z,
                   config=AlgoConfig(lr=1.0, clip=c), noise_seed=secret)
    idx = eng.sampler.sample()
    eng.step(x[idx], y[idx], idx)
    released = (w0 - torch.cat([p.detach().flatten() for p in model.parameters()])).double()  # lr = 1
    std, d = z * c / B, len(w0)

    noises = _candidate_noises(range(1 << 14), d)
    assert torch.equal(noises[secret], normals(SecretKey.from_seed(secret), Purpose.NOISE, 0, 0, d))
    scores = noises @ released / (noises.norm(dim=1) * released.norm())
    best = int(scores.argmax())
    assert best == secret
    runner_up = float(scores.topk(2).values[1])
    assert float(scores[best]) > 0.8 > runner_up + 0.2

    # the exact clipped sum of the batch, recovered: released - std Z = sum clip(g_i) / B to the grid
    recovered = released - std * noises[best]
    from clipbias.grads.rows import FuncGradients
    torch.nn.utils.vector_to_parameters(w0, model.parameters())
    g, _ = FuncGradients(model, torch.nn.functional.cross_entropy)(x[idx], y[idx])
    truth = (g * torch.clamp(c / g.norm(dim=1, keepdim=True), max=1.0)).sum(0).double() / B
    assert torch.allclose(recovered, truth, atol=noise_grid(std) + 1e-6)

    default = DPEngine(torch.nn.Linear(d_in, classes), "dpsgd", n=n, batch_size=B, steps=1, noise_multiplier=z)
    assert not default.key.reproducible and default.privacy(1).certified
    assert len(default.key.bytes) * 8 == 256


def _candidate_noises(seeds, d: int) -> torch.Tensor:
    """The first noise draw of each candidate seed's key, as the attacker computes it: the keystream
    per candidate, one batched Box-Muller (the layout of ``draws.normals``: H, L, A runs per chunk)."""
    from clipbias.randomness.draws import _CHUNK_PAIRS, box_muller
    from clipbias.randomness.key import nonce
    pairs, address = -(-d // 2), nonce(Purpose.NOISE, 0, 0)
    runs = np.stack([np.stack([keystream(SecretKey.from_seed(s).bytes, address, 8 * pairs, part * _CHUNK_PAIRS // 8)
                               .view("<u8") for part in range(3)]) for s in seeds])  # [candidates, 3, pairs]
    h, l, a = runs.transpose(1, 0, 2).reshape(3, -1)
    w = torch.from_numpy(np.stack([v.astype(np.float64) for v in (h, l, a, ~h, ~l)]))
    return box_muller(w).view(len(runs), pairs, 2).reshape(len(runs), -1)[:, :d]


# ------------------------------------------------------------------ nothing else on the secret path
SECRET_FREE = {  # modules whose seeded generators draw public or experimental randomness only
    "analysis/toy.py": "the toy problems' synthetic data",
    "analysis/symmetry.py": "measurement projections of an instrument that is not private",
    "analysis/instruments.py": "measurement draws of an instrument that is not private",
    "cli/diagnose.py": "which examples the (non-private) diagnostics measure",
    "audit/canary.py": "the audit experiment's own inclusion draws",
    "audit/one_run.py": "the audit experiment's canaries and model initialisation",
    "audit/white_box.py": "the audit experiment's canary inclusion draws",
    "algorithms/batchclip.py": "which public test images become public features",
    "run/build.py": "the public model initialisation",
    "sampling/loader.py": "DataLoader worker seeds (the user's dataset randomness, not the mechanism's), a ChaCha20 output",
    "models/gpt.py": "the public model initialisation",
    "grads/conv_rows.py": "stand-in data on which the conv kernels are timed (never the model's input or output)",
}


RANDOM_DRAWS = {"rand", "randn", "randint", "randperm", "bernoulli", "normal", "multinomial", "poisson", "rand_like",
                "randn_like", "randint_like", "normal_", "uniform_", "bernoulli_", "random_", "exponential_",
                "geometric_", "cauchy_", "log_normal_"}
SEEDING = {"manual_seed", "manual_seed_all", "seed", "seed_all", "RandomState", "default_rng", "Random",
           "SeedSequence", "PCG64", "Philox", "MT19937", "SFC64", "Generator"}


def seeded_or_global_draws(tree: ast.AST) -> list[tuple[int, str]]:
    """Calls that seed a generator (any spelling) or draw from torch's global generator (no
    ``generator=``): the forms a secret draw must never take."""
    hits = []
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name in SEEDING or (name in RANDOM_DRAWS and not any(k.arg == "generator" for k in n.keywords)):
            hits.append((n.lineno, name))
    return hits


def test_the_walker_sees_every_spelling():
    snippet = ("import random, numpy as np, torch\nfrom torch import manual_seed\n"
               "def f(v):\n    z = torch.randn(v.shape)\n    v.normal_()\n    torch.cuda.manual_seed_all(1)\n"
               "    r = random.Random(5)\n    g = np.random.Generator(np.random.PCG64(7))\n    manual_seed(3)\n"
               "    ok = torch.randn(3, generator=keyed)\n")
    names = [n for _, n in seeded_or_global_draws(ast.parse(snippet))]
    assert names.count("randn") == 1 and {"normal_", "manual_seed_all", "Random", "Generator", "PCG64",
                                          "manual_seed"} <= set(names)


def test_no_seeded_generator_outside_the_public_uses():
    """Seeded generators (torch, numpy, random) and draws from torch's global generator appear only in
    modules whose randomness is public (listed with the reason); the secret path draws from the key."""
    root = pathlib.Path(__file__).resolve().parents[1] / "clipbias"
    found = {}
    for path in root.rglob("*.py"):
        hits = seeded_or_global_draws(ast.parse(path.read_text()))
        if hits:
            found[str(path.relative_to(root))] = hits
    assert set(found) <= set(SECRET_FREE), {k: v for k, v in found.items() if k not in SECRET_FREE}


def test_int_list_is_the_elementwise_conversion():
    """``int_list`` (one ``tolist``) gives what iterating the ids and calling ``int`` gave: Python ints, in
    order, from integer, float and bool tensors, a slice of one, and plain sequences."""
    from clipbias.randomness import int_list
    perm = torch.randperm(1000)
    for ids in (perm, perm.to(torch.int32), perm[10:300:7], torch.tensor([1.0, 2.9, -3.5]),
                torch.tensor([True, False]), torch.empty(0, dtype=torch.long), [3, 1, 2], range(4)):
        got = int_list(ids)
        assert got == [int(i) for i in ids] and all(type(v) is int for v in got)
