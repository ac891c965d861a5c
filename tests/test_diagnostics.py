"""Diagnostics instruments against hand-built gradient sets with known answers, and a CLI smoke run."""

import json
import math

import pytest
import torch

from clipbias.analysis import diagnostics as D
from clipbias.cli import main


torch.set_num_threads(1)  # small tensors: extra threads only spin on a shared machine


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def exponential(n, d, seed):
    """Seeded Exponential(1) draws (skewness 2 in every coordinate), independent of the global RNG."""
    return -torch.log1p(-torch.rand(n, d, generator=gen(seed), dtype=torch.float64))


# ----------------------------------------------------------------------------- norms, noise, bias

def test_norm_stats_known_set():
    g = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [0.0, -4.0]])  # norms 1, 2, 3, 4
    s = D.norm_stats(g, clip=2.5)
    assert s["q25"] == pytest.approx(1.75)
    assert s["q50"] == pytest.approx(2.5)
    assert s["q75"] == pytest.approx(3.25)
    assert s["fraction_clipped"] == pytest.approx(0.5)
    assert s["mean_grad_norm"] == pytest.approx(math.hypot(1.0, -0.5))
    assert s["mean_norm"] == pytest.approx(2.5) and s["max_norm"] == pytest.approx(4.0) and s["n"] == 4
    assert D.norm_stats(g, clip=4.0)["fraction_clipped"] == 0.0  # ||g_i|| = C is not clipped


def test_sampling_noise_definition_2_5_before_and_after_clipping():
    g = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 2.0], [0.0, -2.0]])  # mean 0
    assert D.sampling_noise(g) == pytest.approx((1 + 1 + 4 + 4) / 4)
    s = D.sampling_noise_stats(g, clip=1.0)  # every clipped row has norm 1, mean still 0
    assert s["before"] == pytest.approx(2.5) and s["after"] == pytest.approx(1.0)
    assert s["tau_before"] == pytest.approx(math.sqrt(2.5)) and s["tau_after"] == pytest.approx(1.0)
    # shifting every row by a constant changes nothing before clipping
    assert D.sampling_noise(g + torch.tensor([5.0, -7.0])) == pytest.approx(2.5)


def test_clipping_bias_recovers_a_known_vector():
    g = torch.tensor([[3.0, 0.0], [0.0, 0.5]])  # clip 1: (1, 0), (0, 0.5)
    b = D.clipping_bias(g, clip=1.0)
    assert torch.allclose(b["vector"], torch.tensor([-1.0, 0.0], dtype=torch.float64))
    assert b["norm"] == pytest.approx(1.0)
    assert b["relative_norm"] == pytest.approx(1.0 / math.hypot(1.5, 0.25))  # ||b|| / ||mean g||
    assert b["cos_true"] == pytest.approx(-1.5 / math.hypot(1.5, 0.25))
    assert b["cos_clipped_true"] == pytest.approx((0.75 + 0.0625) / (math.hypot(0.5, 0.25) * math.hypot(1.5, 0.25)))
    # against a given reference direction
    assert D.clipping_bias(g, 1.0, torch.tensor([0.0, 1.0]))["cos_true"] == pytest.approx(0.0, abs=1e-12)
    # no row clipped -> no bias
    assert D.clipping_bias(g, 10.0)["norm"] == pytest.approx(0.0)


def test_high_dim_bias_has_a_closed_form_on_orthogonal_rows():
    """Rows g_i = r_i u_i with orthonormal u_i (d = 30, n = 20): clipping at C = 1 gives min(r_i, 1) u_i,
    so in the basis u the bias has coordinates (min(r_i, 1) - r_i) / n, the mean gradient r_i / n, and
    every norm and cosine is a sum over the radii alone (no clipping code re-implemented)."""
    n, d = 20, 30
    u, _ = torch.linalg.qr(torch.randn(d, n, generator=gen(1), dtype=torch.float64))  # columns orthonormal
    r = torch.linspace(0.1, 5.0, n, dtype=torch.float64)
    g = r[:, None] * u.T
    res = D.clipping_bias(g, 1.0)
    excess = (r - 1).clamp_min(0)            # r_i - min(r_i, 1)
    kept = r.clamp(max=1.0)                  # min(r_i, 1)
    assert torch.allclose(u.T @ res["vector"], -excess / n, atol=1e-12)
    assert res["norm"] == pytest.approx(float(excess.norm()) / n)
    assert res["relative_norm"] == pytest.approx(float(excess.norm() / r.norm()))
    assert res["cos_true"] == pytest.approx(float(-(excess * r).sum() / (excess.norm() * r.norm())))
    assert res["cos_clipped_true"] == pytest.approx(float((kept * r).sum() / (kept.norm() * r.norm())))


# ----------------------------------------------------------------------------- cosines

def test_cosine_histogram_of_known_angles():
    ref = torch.tensor([1.0, 0.0])
    g = torch.tensor([[2.0, 0.0], [-1.0, 0.0], [0.0, 3.0], [1.0, 1.0], [0.0, 0.0]])
    c = D.cosines_to(g, ref)
    assert torch.allclose(c, torch.tensor([1.0, -1.0, 0.0, 1 / math.sqrt(2), 0.0], dtype=torch.float64))
    h = D.cosine_histogram(g, ref, bins=4)  # bins [-1,-.5), [-.5,0), [0,.5), [.5,1]
    assert h["counts"] == [1, 0, 2, 2]
    assert h["fraction_negative"] == pytest.approx(0.2)
    assert h["mean"] == pytest.approx((1 - 1 + 1 / math.sqrt(2)) / 5)
    assert h["median"] == pytest.approx(0.0, abs=1e-12)  # sorted: -1, 0, 0, 0.71, 1
    assert h["edges"] == pytest.approx([-1.0, -0.5, 0.0, 0.5, 1.0])


def test_cosine_histogram_is_symmetric_for_a_symmetric_noise_set():
    xi = torch.randn(200, 20, generator=gen(2))
    g = torch.cat([xi, -xi])  # cosines with any direction come in +- pairs
    h = D.cosine_histogram(g, torch.linspace(-1, 2, 20))
    assert h["counts"] == h["counts"][::-1]
    assert sum(h["counts"]) == 400 and max(h["counts"]) < 200  # every cosine counted, spread over bins
    assert h["fraction_negative"] == 0.5  # no cosine is exactly 0: half of each +- pair is negative
    assert abs(h["mean"]) < 1e-9 and abs(h["skewness"]) < 1e-6
    assert float(h["values"].abs().mean()) > 0.05  # 20-D Gaussian directions: |cos| ~ 1/sqrt(20)


# ----------------------------------------------------------------------------- symmetry

def test_a_centrally_symmetric_set_scores_one_in_every_projection():
    xi = torch.randn(100, 40, generator=gen(3), dtype=torch.float64) * torch.linspace(0.1, 3, 40)
    g = torch.cat([xi, -xi]) + torch.linspace(-1, 1, 40)  # symmetric about a non-zero mean
    assert D.symmetry_score(g) == pytest.approx(1.0, abs=1e-7)
    sym = D.projection_symmetry(g, k=8, generator=gen(4))
    assert sym["projections"].shape == (8, 200, 2)
    assert all(s == pytest.approx(1.0, abs=1e-7) for s in sym["scores"])
    assert sym["mean_score"] == pytest.approx(1.0, abs=1e-7) and sym["min_score"] == pytest.approx(1.0, abs=1e-7)
    assert sym["full_dim_score"] == pytest.approx(1.0, abs=1e-4)  # Gram route (see asymmetry)
    assert sym["null"] < 1.0  # a random-sign sample is symmetric only in distribution


def test_asymmetric_sets_score_below_symmetric_ones():
    # {-2, 1, 1}, centred already; over the 9 ordered pairs S+ = mean |y_i + y_j| = 16/9 and
    # S- = mean |y_i - y_j| = 12/9 (hand-computed): R = 1/4, score 1 - sqrt(1/4)
    assert D.symmetry_score(torch.tensor([[-2.0], [1.0], [1.0]])) == pytest.approx(0.5)
    e = exponential(300, 2, seed=0)  # skewed in both coordinates (docstring: about 0.73)
    gauss = torch.randn(300, 2, generator=gen(5))
    assert D.symmetry_score(e) < 0.85 < D.symmetry_null(e)
    assert D.symmetry_score(gauss) > 0.9
    assert D.symmetry_score(torch.ones(5, 3)) == 1.0  # degenerate: all points equal


def test_symmetry_score_is_invariant_to_shift_rotation_and_scale():
    y = exponential(80, 3, seed=6)
    q, _ = torch.linalg.qr(torch.randn(3, 3, generator=gen(6), dtype=torch.float64))
    s = D.symmetry_score(y)
    assert s < 0.9  # a skewed set: the invariance below is not that of a constant
    assert D.symmetry_score(3.0 * y @ q + 7.0) == pytest.approx(s, rel=1e-9)


def test_projections_of_a_skewed_set_score_below_their_null():
    """Skewed (exponential) gradients stay skewed under random 2-D projections: every projected score
    is below the sign-flip null, and the full-dimensional score is the unprojected set's score."""
    g = exponential(200, 3, seed=7)
    sym = D.projection_symmetry(g, k=8, generator=gen(4))
    assert len(sym["scores"]) == 8 and max(sym["scores"]) < 0.9 < sym["null"]
    assert sym["mean_score"] == pytest.approx(sum(sym["scores"]) / 8) and sym["min_score"] == min(sym["scores"])
    assert sym["full_dim_score"] == pytest.approx(D.symmetry_score(g), abs=1e-5) and sym["full_dim_score"] < 0.9
    assert sym["full_dim_null"] > 0.9
    for proj, score in zip(sym["projections"], sym["scores"]):  # each score is that projection's score
        assert D.symmetry_score(proj) == pytest.approx(score, abs=1e-12)


def test_random_projections_are_gaussian_linear_maps_and_reproducible():
    """Projecting the identity rows (g = I_d) reads off the k matrices P_j; any g then projects to
    g @ P_j, their entries have variance 1/d, the same generator seed gives the same matrices and
    another seed other ones."""
    d = 400
    p = D.random_projections(torch.eye(d), 3, gen(8))  # [3, d, 2]: P_j itself
    assert p.shape == (3, d, 2)
    g = torch.randn(10, d, generator=gen(7), dtype=torch.float64)
    proj = D.random_projections(g, 3, gen(8))
    assert proj.shape == (3, 10, 2)
    assert torch.allclose(proj, g @ p, atol=1e-12)
    assert torch.allclose(D.random_projections(2 * g, 3, gen(8)), 2 * proj)
    for pj in p:
        assert float(pj.var()) * d == pytest.approx(1.0, abs=0.15)   # N(0, 1/d) entries
        assert abs(float(pj.mean())) < 4 / math.sqrt(2 * d * d)       # mean 0 (4 standard errors)
    assert not torch.allclose(p[0], p[1])                            # k independent matrices
    assert not torch.allclose(D.random_projections(g, 3, gen(9)), proj)
    centred = D.random_projections(g, 3, gen(8), center=True)
    assert torch.allclose(centred, (g - g.mean(0)) @ p, atol=1e-12)


# ----------------------------------------------------------------------------- noise correlation

def ar1(rho, T=120, m=6, d=400, seed=9):
    g = gen(seed)
    xi = torch.zeros(T, m, d, dtype=torch.float64)
    xi[0] = torch.randn(m, d, generator=g, dtype=torch.float64)
    for t in range(1, T):
        xi[t] = rho * xi[t - 1] + math.sqrt(1 - rho ** 2) * torch.randn(m, d, generator=g, dtype=torch.float64)
    return xi


def window_theory(rho, k):
    """E||mean of k AR(1) terms||^2 / E||one term||^2."""
    return (k + 2 * sum((k - h) * rho ** h for h in range(1, k))) / k ** 2


@pytest.mark.parametrize("rho", [0.0, 0.6, 0.95])
def test_noise_correlation_measures_a_known_ar1_correlation(rho):
    xi = ar1(rho)
    assert D.noise_lag_correlation(xi) == pytest.approx(rho, abs=0.03)
    w = D.window_noise_norms(xi, (1, 2, 4, 8))
    for k in (2, 4, 8):
        assert w[k] / w[1] == pytest.approx(math.sqrt(window_theory(rho, k)), abs=0.03)


def test_identical_noise_does_not_average_out():
    xi = torch.randn(1, 4, 50, generator=gen(10)).repeat(20, 1, 1)
    w = D.window_noise_norms(xi, (1, 4, 16, 21))
    assert w[1] == pytest.approx(float(xi[0].double().norm(dim=1).mean()))  # mean ||xi^(i)|| over the 4 examples
    assert w[16] == pytest.approx(w[1]) and w[4] == pytest.approx(w[1])
    assert 21 not in w  # a window longer than T = 20 is left out
    assert D.noise_lag_correlation(xi) == pytest.approx(1.0)


def test_online_tracker_equals_the_offline_functions():
    xi = ar1(0.5, T=30, m=3, d=20)
    tr = D.NoiseTracker((1, 2, 4, 8))
    for t in range(len(xi)):
        tr.observe(xi[t])
    res = tr.result()
    off = D.window_noise_norms(xi, (1, 2, 4, 8))
    assert res["windows"] == [1, 2, 4, 8] and res["iterations"] == 30
    assert res["mean_norm"] == pytest.approx([off[k] for k in (1, 2, 4, 8)])
    assert res["ratio_to_k1"] == pytest.approx([off[k] / off[1] for k in (1, 2, 4, 8)])
    assert len(tr.buf) == 8  # memory: max(windows) iterations, not the whole run
    assert res["lag1_correlation"] == pytest.approx(D.noise_lag_correlation(xi))


# ----------------------------------------------------------------------------- p-averaging

def test_p_averaging_known_values():
    """Rows (3, 0) and (0, 0.5), C = 1, hand-computed. p = 1: clipped rows (1, 0), (0, 0.5), mean
    (0.5, 0.25); p = 2: one group, mean (1.5, 0.25) clipped to norm 1, parallel to it. The true
    gradient is the mean (1.5, 0.25), or the given reference (0, 1)."""
    g = torch.tensor([[3.0, 0.0], [0.0, 0.5]])
    cos = D.p_averaged_cosines(g, 1.0, ps=(0, 1, 2, 5))
    assert set(cos) == {1, 2}  # p < 1 and p > n are left out
    assert cos[1] == pytest.approx((0.75 + 0.0625) / (math.hypot(0.5, 0.25) * math.hypot(1.5, 0.25)))
    assert cos[2] == pytest.approx(1.0)  # one group: clip(mean) is parallel to the mean
    ref = D.p_averaged_cosines(g, 1.0, ps=(1, 2), reference=torch.tensor([0.0, 1.0]))
    assert ref[1] == pytest.approx(0.25 / math.hypot(0.5, 0.25))
    assert ref[2] == pytest.approx(0.25 / math.hypot(1.5, 0.25))
    # the p-averaged vector itself: p = 2 clips the mean (1.5, 0.25) to norm 1
    v = D.p_averaged_clipped(g, 1.0, 2)
    assert torch.allclose(v, torch.tensor([1.5, 0.25], dtype=torch.float64) / math.hypot(1.5, 0.25))
    assert torch.allclose(D.p_averaged_clipped(g, 1.0, 1), torch.tensor([0.5, 0.25], dtype=torch.float64))
    with pytest.raises(ValueError, match="p must be >= 1"):
        D.p_averaged_clipped(g, 1.0, 0)


@pytest.mark.parametrize("rows, p, outcomes", [
    # rows 1, 2, 4, p = 2: groups of 2 and 1 (the remainder alone); the unclipped result is the mean of
    # the two group means: 2 (remainder 1), 2.25 (remainder 2) or 2.75 (remainder 4). Dropping the
    # remainder gives 1.5, 2.5 or 3; merging it into the last group, or ignoring p, 7/3.
    ([1.0, 2.0, 4.0], 2, {2.0, 2.25, 2.75}),
    # rows 1, 1, 1, 1, 7, p = 2: three groups (2, 2, 1): 7 alone gives (1 + 1 + 7) / 3 = 3, 7 in a pair
    # (4 + 1 + 1) / 3 = 2. Two groups of 3 and 2 (the remainder merged, or p groups) give 2 or 2.5;
    # dropping the remainder 1 or 2.5; ignoring p (or p = 1) 11/5.
    ([1.0, 1.0, 1.0, 1.0, 7.0], 2, {2.0, 3.0}),
    # rows 0, 0, 0, 12, p = 3: groups (3, 1): 12 alone gives (0 + 12) / 2 = 6, 12 in the triple
    # (4 + 0) / 2 = 2. Ignoring p: 3 (p = 1) or 3 (p = n); the remainder dropped: 0 or 4.
    ([0.0, 0.0, 0.0, 12.0], 3, {2.0, 6.0}),
])
def test_p_averaging_groups_with_remainder(rows, p, outcomes):
    """No clipping (C = 100): whatever the random grouping, the result is the mean of the group means,
    hand-computed for each possible position of the odd row; across 40 generator seeds every
    possible grouping occurs and nothing else does."""
    g = torch.tensor(rows, dtype=torch.float64).unsqueeze(1)
    seen = {round(float(D.p_averaged_clipped(g, 100.0, p, gen(s))[0]), 9) for s in range(40)}
    assert seen == outcomes


def test_p_averaging_removes_the_bias_of_a_skewed_set():
    """Nine rows +1 and one row -20 (mean -1.1: the true direction is -x), C = 1. Hand-computed,
    independent of the grouping: p = 1 clips every row, mean +0.8, cos = -1 (flipped); p = 2 and p = 4
    leave one group dominated by -20 (clipped to -1) and the others at +1: mean > 0, cos = -1; p = 5:
    one group -1, one +1, mean 0 (up to the clip's rounding margin, 3e-14 in float64: the cosine of
    that residue is not asserted); p = 10: one group, clip(-1.1) = -1, cos = +1."""
    g = torch.cat([torch.ones(9, 1), torch.full((1, 1), -20.0)]).double() * torch.tensor([[1.0, 0.0]])
    cos = D.p_averaged_cosines(g, 1.0, (1, 2, 4, 10), generator=gen(3))
    assert cos == pytest.approx({1: -1.0, 2: -1.0, 4: -1.0, 10: 1.0}, abs=1e-12)
    assert float(D.p_averaged_clipped(g, 1.0, 5, gen(3)).norm()) < 1e-12


# ----------------------------------------------------------------------------- driver and CLI

def test_instruments_bundle_is_json_able():
    g = torch.randn(40, 12, generator=gen(12)) * 3
    full = D.instruments(g, 1.0, projections=4, ps=(1, 2, 4))
    rec = D.strip_arrays(full)
    json.dumps(rec)
    assert set(rec) >= {"norms", "sampling_noise", "clipping_bias", "cosine_histogram", "symmetry", "p_averaging",
                        "p_averaging_ceiling"}
    assert "_arrays" in full and "_arrays" not in rec
    assert len(rec["symmetry"]["scores"]) == 4 and full["_arrays"]["projections"].shape == (4, 40, 2)
    assert rec["norms"]["n"] == 40 and sum(rec["cosine_histogram"]["counts"]) == 40
    assert list(rec["p_averaging"]) == ["1", "2", "4"]


def test_instruments_bundle_values_on_a_known_set():
    """The bundle of the hand-computed set of test_clipping_bias_recovers_a_known_vector and
    test_p_averaging_known_values: rows (3, 0), (0, 0.5), C = 1."""
    g = torch.tensor([[3.0, 0.0], [0.0, 0.5]])
    m = math.hypot(1.5, 0.25)  # ||mean g||
    rec = D.instruments(g, 1.0, projections=2, ps=(1, 2))
    assert rec["norms"]["fraction_clipped"] == 0.5 and rec["norms"]["mean_grad_norm"] == pytest.approx(m)
    assert rec["clipping_bias"]["norm"] == pytest.approx(1.0) and "vector" not in rec["clipping_bias"]
    assert rec["sampling_noise"]["before"] == pytest.approx((1.5 ** 2 + 0.25 ** 2))  # rows +-(1.5, -0.25) off the mean
    assert rec["p_averaging"] == pytest.approx({"1": (0.75 + 0.0625) / (math.hypot(0.5, 0.25) * m), "2": 1.0})
    assert rec["p_averaging_ceiling"] == pytest.approx(1.0)  # no reference: the mean itself
    assert rec["true_gradient_norm"] == pytest.approx(m) and rec["reference"] == "mean of the recorded rows"
    # with a reference (0, 1): every cosine is taken against it
    rec = D.instruments(g, 1.0, torch.tensor([0.0, 2.0]), projections=2, ps=(1, 2))
    assert rec["p_averaging"] == pytest.approx({"1": 0.25 / math.hypot(0.5, 0.25), "2": 0.25 / m})
    assert rec["p_averaging_ceiling"] == pytest.approx(0.25 / m)  # cos(mean g, reference): no clipping
    assert rec["clipping_bias"]["cos_true"] == pytest.approx(0.0, abs=1e-12)  # b = (-1, 0) is orthogonal to it
    assert rec["true_gradient_norm"] == pytest.approx(2.0) and rec["reference"] == "full-batch gradient (given)"


def test_diagnose_cli_writes_json_and_figures(tmp_path, capsys):
    out = tmp_path / "diag"
    rc = main(["diagnose", "--data", "digits", "--model", "logreg", "--algo", "clip-sgd", "--epochs", "1",
               "--batch-size", "50", "--lr", "0.5", "--subset", "200", "--record-size", "60",
               "--reference-size", "200", "--track-size", "8", "--track-reference-size", "50",
               "--steps-at", "0,2,end", "--projections", "4", "--out", str(out), "--quiet", "--json"])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    res = json.loads((out / "diagnostics.json").read_text())
    assert "NOT differentially private" in res["privacy_warning"] == printed["privacy_warning"]
    assert [r["step"] for r in res["records"]] == [0, 2, 4]
    assert res["diagnostics"]["reference"] == "full training set"
    assert res["noise_correlation"]["iterations"] == 4
    assert res["training_privacy"]["epsilon"] == "inf"  # clip-sgd is non-private
    for name in ("norms", "sampling_noise", "clipping_bias", "cosine_histogram", "projections",
                 "symmetry", "noise_correlation", "p_averaging"):
        assert (out / f"{name}.png").stat().st_size > 5000, name
    again = ["diagnose", "--data", "digits", "--model", "logreg", "--algo", "clip-sgd", "--out", str(out), "--quiet"]
    assert main(again) == 2  # an earlier diagnose is not replaced silently
    assert "diagnostics.json exists" in capsys.readouterr().err and (out / "norms.png").exists()


def test_diagnose_reads_a_saved_run_config_and_flags_win(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    cfg = {"data": "digits", "model": "logreg", "algo": "dpsgd", "noise_multiplier": 2.0, "epsilon": None,
           "epochs": 1, "batch_size": 40.0, "lr": 0.3, "clip": 0.5, "subset": 120, "seed": 1, "extra": {}}
    (run / "results.json").write_text(json.dumps({"config": cfg}))
    rc = main(["diagnose", "--run", str(run), "--clip", "0.7", "--record-size", "30", "--track-size", "0",
               "--steps-at", "end", "--no-figures", "--quiet"])
    assert rc == 0
    res = json.loads((run / "diagnostics.json").read_text())
    assert res["config"]["clip"] == 0.7 and res["config"]["lr"] == 0.3 and res["config"]["algo"] == "dpsgd"
    assert res["config"]["noise_multiplier"] == 2.0 and res["data"]["n"] == 120
    assert res["training_privacy"]["noise_multiplier"] == 2.0
    assert res["records"][0]["clip"] == 0.7 and res["noise_correlation"] is None


def test_diagnose_rejects_bad_steps(tmp_path, capsys):
    rc = main(["diagnose", "--data", "digits", "--model", "logreg", "--algo", "sgd", "--subset", "100",
               "--batch-size", "50", "--steps-at", "0,99", "--out", str(tmp_path), "--quiet"])
    assert rc == 2
    assert "--steps-at" in capsys.readouterr().err


def test_diagnose_at_a_saved_checkpoint(tmp_path):
    from clipbias.run.training import TrainConfig, train

    run = tmp_path / "run"
    train(TrainConfig(data="digits", model="logreg", algo="clip-sgd", epochs=1, batch_size=50.0, lr=0.5,
                      subset=200, out=str(run)), plot=False)
    rc = main(["diagnose", "--run", str(run), "--at-checkpoint", "--record-size", "40", "--no-figures",
               "--quiet"])
    assert rc == 0
    res = json.loads((run / "diagnostics.json").read_text())
    assert res["at_checkpoint"] and len(res["records"]) == 1
    assert res["records"][0]["step"] == 4  # round(200 / 50) steps of one epoch
    assert res["config"]["algo"] == "clip-sgd" and res["data"]["n"] == 200
    at_ckpt = res["records"][0]
    assert at_ckpt["norms"]["n"] == 40 and at_ckpt["reference"] == "full-batch gradient (given)"
    # the same examples recorded on the run's initial model (same config and seed, before any step):
    # the checkpoint's weights were loaded, so its gradients differ from the initial model's
    rc = main(["diagnose", "--run", str(run), "--steps-at", "0", "--record-size", "40", "--track-size", "0",
               "--no-figures", "--quiet", "--overwrite"])  # replaces the first diagnose's file
    assert rc == 0
    init = json.loads((run / "diagnostics.json").read_text())["records"][0]
    assert init["step"] == 0 and not json.loads((run / "diagnostics.json").read_text())["at_checkpoint"]
    for key in ("mean_grad_norm", "q50"):
        assert at_ckpt["norms"][key] != pytest.approx(init["norms"][key], rel=1e-3), key
    assert at_ckpt["true_gradient_norm"] != pytest.approx(init["true_gradient_norm"], rel=1e-3)
