"""The banded audit's statistics against scoring the updates as independent releases (docs/privacy.md,
"Banded noise"): q = 0.05, z = 1, T = 100, b = 4, the canary's class 0 known, 20,000 runs per world.

The naive adversary is the same ``_Statistic`` with the coefficients replaced by (1,): it scores the
updates u the optimizer receives as if they were the releases (their noise is correlated).

    PYTHONPATH=. .venv/bin/python benchmarks/audits_bands_naive.py
"""

from clipbias import audit
from clipbias.audit import canary

plain_init = canary._Statistic.__init__


def naive_init(self, *args, **kwargs):
    plain_init(self, *args, **kwargs)
    if self.bands > 1:
        self.coefs = (1.0,)


for name, init in (("blocks of y = C u", plain_init), ("u as releases", naive_init)):
    canary._Statistic.__init__ = init
    for stat in ("lr", "sum"):
        a = audit.CanaryAudit("dpsgd", 1.0, 0.05, 100, 10.0, trials=20000, statistic=stat, bands=4, band_class=0,
                              band_momentum=0.9)
        r = audit.canary_audit(a)
        print(f"{name:18s} {stat:3s}: lower bound {r['epsilon_lower_bound']:.3f}, GDP {r['epsilon_lower_bound_gdp']:.3f}, "
              f"claim {r['epsilon_claimed']:.3f}", flush=True)
canary._Statistic.__init__ = plain_init
