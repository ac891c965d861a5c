"""Empirical privacy auditing: experiments that can refute an accounting claim.

An accountant's epsilon is a proof; an audit is a distinguishing experiment whose success gives a
*lower* bound on the true epsilon at a stated confidence, so a claim below it is false (and a claim
above it is merely not refuted). Two experiments (docs/privacy.md, "Audits"):

* ``canary``: the white-box Monte-Carlo test of ``canary.py``, thousands of runs per world through
  the algorithm's own pipeline stages;
* ``one_run``: Steinke, Nasr & Jagielski (2023), many canaries in one real training run.
"""

from .canary import CanaryAudit, canary_audit, check_batched, claim, simulate
from .estimators import epsilon_from_scores, one_run_estimate
from .one_run import CanaryGradients, OneRunAudit, one_run_audit
from .stats import epsilon_lower_bound, one_run_epsilon_lower_bound, one_run_p_value
from .white_box import white_box_one_run

__all__ = ["CanaryAudit", "canary_audit", "check_batched", "claim", "simulate", "CanaryGradients",
           "epsilon_from_scores", "one_run_estimate", "OneRunAudit", "one_run_audit", "epsilon_lower_bound",
           "one_run_epsilon_lower_bound", "one_run_p_value", "white_box_one_run"]
