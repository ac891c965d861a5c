"""compare names a best configuration only when its lead exceeds the seeds' spread (``leaders``)."""

from __future__ import annotations

import statistics

from clipbias.cli.compare import best_sound, leaders


def _row(label, accs, certified=True):
    return {"label": label, "certified": certified, "test_accuracies": accs, "epsilon": 2.99,
            "test_accuracy_mean": statistics.mean(accs),
            "test_accuracy_std": statistics.stdev(accs) if len(accs) > 1 else 0.0}


def _summary(rows):
    config = {"algo": "dpsgd", "data": "digits", "model": "logreg", "epsilon": 3.0, "lr": 0.5, "clip": 1.0,
              "momentum": 0.9}
    return {"rows": rows, "runs": {r["label"]: [{"config": {**config, "algo": r["label"]}}] * len(r["test_accuracies"])
                                   for r in rows}}


def test_a_lead_within_the_seed_spread_is_a_tie():
    """The case that motivated the rule: 88.13 against 88.10 % over 3 seeds, spreads of ~0.1-0.2."""
    dice, dpsgd = _row("dice", [0.8800, 0.8813, 0.8826]), _row("dpsgd", [0.8790, 0.8810, 0.8830])
    best, tied = leaders([dpsgd, dice])
    assert best is None and [r["label"] for r in tied] == ["dice", "dpsgd"]
    b = best_sound(_summary([dpsgd, dice]))
    assert b["label"] is None and b["tied"] == ["dice", "dpsgd"] and b["command"] is None
    assert b["line"].startswith("best sound configuration: a tie (3 seeds: dice 88.13 ± 0.13 %, dpsgd 88.10 ± 0.20 %")


def test_a_lead_beyond_both_spreads_names_the_best_and_the_rule_uses_the_larger_spread():
    lead = _row("bands", [0.8862, 0.8887, 0.8890])       # mean 88.797, std 0.154
    tight = _row("dpsgd", [0.8801, 0.8803, 0.8805])      # mean 88.03, std 0.02: lead 0.77 > 0.154
    best, tied = leaders([tight, lead])
    assert best["label"] == "bands" and tied == []
    b = best_sound(_summary([tight, lead]))
    assert b["label"] == "bands" and b["command"].startswith("clipbias train") and "--algo bands" in b["command"]
    wide = _row("wide", [0.8650, 0.8800, 0.8950])        # mean 88.00, std 1.5: lead 0.80 <= 1.5 (its spread)
    best, tied = leaders([tight, lead, wide])
    assert best is None and [r["label"] for r in tied] == ["bands", "wide"]  # dpsgd is behind, not tied


def test_uncertified_rows_and_one_seed():
    lead = _row("dice:authors", [0.95, 0.951, 0.952], certified=False)  # refuted bound: never a candidate
    a, b = _row("a", [0.88, 0.881, 0.882]), _row("b", [0.85, 0.851, 0.852])
    assert leaders([lead, a, b]) == (a, [])
    assert leaders([lead]) == (None, []) and best_sound(_summary([lead])) is None
    assert leaders([a]) == (a, [])  # a single certified row has nothing to lead
    one, two = _row("a", [0.90]), _row("b", [0.80])
    best, tied = leaders([one, two])  # one seed: no spread to judge a lead by
    assert best is None and tied == [one, two]
    assert "one seed measures no spread" in best_sound(_summary([one, two]))["line"]
