"""Noise multiplier of DiceSGD under sound accounting vs the feedback ratio r, against DPSGD's.

    python benchmarks/sound_cost.py        # prints the markdown table of docs/privacy.md (~5 min, 1 core)

Scales: the README example (Fashion-MNIST, B = 256, 10 epochs) and the two benchmark models of
docs/results.md (cnn: B = 2048, 5 epochs; scatter-linear: B = 8192, 10 epochs). delta = 1e-5.
"""

from __future__ import annotations

import sys

from clipbias.privacy import dice, gaussian

SCALES = [("B = 256, 10 epochs (T = 2340)", 256, 2340), ("cnn: B = 2048, 5 epochs (T = 145)", 2048, 145),
          ("scatter-linear: B = 8192, 10 epochs (T = 70)", 8192, 70)]
RATIOS = (0.001, 0.01, 0.1, 1.0)
EPSILONS = (1.0, 3.0)


def main() -> int:
    n = 60000
    print("| scale | target eps | DPSGD z | " + " | ".join(f"DiceSGD z, r = {r:g}" for r in RATIOS) + " |")
    print("|---|---|---|" + "---|" * len(RATIOS))
    for label, b, steps in SCALES:
        q = b / n
        for eps in EPSILONS:
            z0 = gaussian.calibrate(eps, 1e-5, q, steps, "pld")
            cells = []
            for r in RATIOS:
                z = dice.calibrate(eps, 1e-5, dice.DiceParams(q, steps, 1.0, r / b, b), "sound")
                cells.append(f"{z:.3f} ({z / z0:.2f}x)")
            print(f"| {label} | {eps:g} | {z0:.3f} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
