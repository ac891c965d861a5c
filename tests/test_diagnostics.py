"""Diagnostics instruments against hand-built gradient sets with known answers, and a CLI smoke run."""

import json
import math

import pytest
import torch

from clipbias import diagnostics as D
from clipbias.cli import main


torch.set_num_threads(1)  # small tensors: extra threads only spin on a shared machine


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- norms, noise, bias

def test_norm_stats_known_set():
    g = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [0.0, -4.0]])  # norms 1, 2, 3, 4
    s = D.norm_stats(g, clip=2.5)
    assert s["q25"] == pytest.approx(1.75)
    assert s["q50"] == pytest.approx(2.5)
    assert s["q75"] == pytest.approx(3.25)
    assert s["fraction_clipped"] == pytest.approx(0.5)
    assert s["mean_grad_norm"] == pytest.approx(math.hypot(1.0, -0.5))


def test_sampling_noise_definition_2_5_before_and_after_clipping():
    g = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 2.0], [0.0, -2.0]])  # mean 0
    assert D.sampling_noise(g) == pytest.approx((1 + 1 + 4 + 4) / 4)
    s = D.sampling_noise_stats(g, clip=1.0)  # every clipped row has norm 1, mean still 0
    assert s["before"] == pytest.approx(2.5) and s["after"] == pytest.approx(1.0)
    assert s["tau_before"] == pytest.approx(math.sqrt(2.5))
    # shifting every row by a constant changes nothing before clipping
    assert D.sampling_noise(g + torch.tensor([5.0, -7.0])) == pytest.approx(2.5)


def test_clipping_bias_recovers_a_known_vector():
    g = torch.tensor([[3.0, 0.0], [0.0, 0.5]])  # clip 1: (1, 0), (0, 0.5)
    b = D.clipping_bias(g, clip=1.0)
    assert torch.allclose(b["vector"], torch.tensor([-1.0, 0.0], dtype=torch.float64))
    assert b["norm"] == pytest.approx(1.0)
    assert b["cos_true"] == pytest.approx(-1.5 / math.hypot(1.5, 0.25))
    assert b["cos_clipped_true"] == pytest.approx((0.75 + 0.0625) / (math.hypot(0.5, 0.25) * math.hypot(1.5, 0.25)))
    # against a given reference direction
    assert D.clipping_bias(g, 1.0, torch.tensor([0.0, 1.0]))["cos_true"] == pytest.approx(0.0, abs=1e-12)
    # no row clipped -> no bias
    assert D.clipping_bias(g, 10.0)["norm"] == pytest.approx(0.0)


def test_random_high_dim_bias_matches_direct_computation():
    g = torch.randn(50, 30, generator=gen(1)) * torch.linspace(0.1, 5, 50).unsqueeze(1)
    b = D.clipping_bias(g, 1.0)["vector"]
    norms = g.double().norm(dim=1, keepdim=True)
    direct = (g.double() * torch.clamp(1.0 / norms, max=1.0)).mean(0) - g.double().mean(0)
    assert torch.allclose(b, direct)


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


def test_cosine_histogram_is_symmetric_for_a_symmetric_noise_set():
    xi = torch.randn(200, 20, generator=gen(2))
    g = torch.cat([xi, -xi])  # cosines with any direction come in +- pairs
    h = D.cosine_histogram(g, torch.linspace(-1, 2, 20))
    assert h["counts"] == h["counts"][::-1]
    assert abs(h["mean"]) < 1e-9 and abs(h["skewness"]) < 1e-6


# ----------------------------------------------------------------------------- symmetry

def test_a_centrally_symmetric_set_scores_one_in_every_projection():
    xi = torch.randn(100, 40, generator=gen(3), dtype=torch.float64) * torch.linspace(0.1, 3, 40)
    g = torch.cat([xi, -xi]) + torch.linspace(-1, 1, 40)  # symmetric about a non-zero mean
    assert D.symmetry_score(g) == pytest.approx(1.0, abs=1e-7)
    sym = D.projection_symmetry(g, k=8, generator=gen(4))
    assert sym["projections"].shape == (8, 200, 2)
    assert all(s == pytest.approx(1.0, abs=1e-7) for s in sym["scores"])
    assert sym["full_dim_score"] == pytest.approx(1.0, abs=1e-4)  # Gram route (see asymmetry)
    assert sym["null"] < 1.0  # a random-sign sample is symmetric only in distribution


def test_asymmetric_sets_score_below_symmetric_ones():
    assert D.symmetry_score(torch.tensor([[-2.0], [1.0], [1.0]])) == pytest.approx(0.5)
    e = torch.distributions.Exponential(1.0).sample((300, 2))  # skewed in both coordinates
    gauss = torch.randn(300, 2, generator=gen(5))
    assert D.symmetry_score(e) < 0.85 < D.symmetry_null(e)
    assert D.symmetry_score(gauss) > 0.9
    assert D.symmetry_score(torch.ones(5, 3)) == 1.0  # degenerate: all points equal


def test_symmetry_score_is_invariant_to_shift_rotation_and_scale():
    y = torch.distributions.Exponential(1.0).sample((80, 3)).double()
    q, _ = torch.linalg.qr(torch.randn(3, 3, generator=gen(6), dtype=torch.float64))
    s = D.symmetry_score(y)
    assert D.symmetry_score(3.0 * y @ q + 7.0) == pytest.approx(s, rel=1e-9)


def test_random_projections_are_linear_and_reproducible():
    g = torch.randn(10, 25, generator=gen(7))
    p1 = D.random_projections(g, 3, gen(8))
    p2 = D.random_projections(2 * g, 3, gen(8))
    assert torch.allclose(p2, 2 * p1)


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
    w = D.window_noise_norms(xi, (1, 4, 16))
    assert w[16] == pytest.approx(w[1]) and w[4] == pytest.approx(w[1])
    assert D.noise_lag_correlation(xi) == pytest.approx(1.0)


def test_online_tracker_equals_the_offline_functions():
    xi = ar1(0.5, T=30, m=3, d=20)
    tr = D.NoiseTracker((1, 2, 4, 8))
    for t in range(len(xi)):
        tr.observe(xi[t])
    res = tr.result()
    off = D.window_noise_norms(xi, (1, 2, 4, 8))
    assert res["windows"] == [1, 2, 4, 8]
    assert res["mean_norm"] == pytest.approx([off[k] for k in (1, 2, 4, 8)])
    assert res["lag1_correlation"] == pytest.approx(D.noise_lag_correlation(xi))


# ----------------------------------------------------------------------------- p-averaging

def test_p_averaging_known_values():
    g = torch.tensor([[3.0, 0.0], [0.0, 0.5]])
    cos = D.p_averaged_cosines(g, 1.0, ps=(1, 2, 5))
    assert cos[1] == pytest.approx((0.75 + 0.0625) / (math.hypot(0.5, 0.25) * math.hypot(1.5, 0.25)))
    assert cos[2] == pytest.approx(1.0)  # one group: clip(mean) is parallel to the mean
    assert 5 not in cos  # p > n is left out


def test_p_averaging_groups_with_remainder():
    """Rows 1, 2, 4 with p = 2 and no clipping: two groups, the remainder alone. Whatever the random
    grouping, the result is the mean of the two group means: 2 (remainder 1), 2.25 (remainder 2) or
    2.75 (remainder 4), and across generator seeds all three occur. Dropping the remainder would give
    1.5, 2.5 or 3; merging it into the last group, or ignoring p, 7/3."""
    g = torch.tensor([[1.0], [2.0], [4.0]], dtype=torch.float64)
    seen = {round(float(D.p_averaged_clipped(g, 100.0, 2, gen(s))[0]), 9) for s in range(40)}
    assert seen == {2.0, 2.25, 2.75}


def test_p_averaging_removes_the_bias_of_a_skewed_set():
    """Nine rows +1 and one row -20 (mean -1.1: the true direction is -x), C = 1. Hand-computed,
    independent of the grouping: p = 1 clips every row, mean +0.8, cos = -1 (flipped); p = 2 and p = 4
    leave one group dominated by -20 (clipped to -1) and the others at +1: mean > 0, cos = -1; p = 5:
    one group -1, one +1, mean 0, cos 0; p = 10: one group, clip(-1.1) = -1, cos = +1."""
    g = torch.cat([torch.ones(9, 1), torch.full((1, 1), -20.0)]).double() * torch.tensor([[1.0, 0.0]])
    cos = D.p_averaged_cosines(g, 1.0, (1, 2, 4, 5, 10), generator=gen(3))
    assert cos == pytest.approx({1: -1.0, 2: -1.0, 4: -1.0, 5: 0.0, 10: 1.0}, abs=1e-12)


# ----------------------------------------------------------------------------- driver and CLI

def test_instruments_bundle_is_json_able():
    g = torch.randn(40, 12, generator=gen(12)) * 3
    rec = D.strip_arrays(D.instruments(g, 1.0, projections=4, ps=(1, 2, 4)))
    json.dumps(rec)
    assert set(rec) >= {"norms", "sampling_noise", "clipping_bias", "cosine_histogram", "symmetry", "p_averaging",
                        "p_averaging_ceiling"}
    assert len(rec["symmetry"]["scores"]) == 4


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
    from clipbias.train import TrainConfig, train

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
