"""``PrivacyEngine.accountant``: Opacus's accountant surface (``opacus.accountants.IAccountant``) over the
engine's own accounting, for the scripts that call ``privacy_engine.accountant.get_epsilon(delta=...)``.

Nothing is accounted here: every number is the engine's (``PrivacyEngine.get_epsilon``), and ``history`` is
read from the engine's settings and the steps it took, so no call on this object can change what the
engine reports, except ``load_state_dict``, which continues a training from its saved state and never
accounts fewer steps than the engine has taken.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from .. import privacy
from ..errors import ConfigError


class Accountant:
    """Opacus's ``IAccountant`` surface of a clipbias ``PrivacyEngine`` (``privacy_engine.accountant``).

    ``get_epsilon(delta)``: ``PrivacyEngine.get_epsilon(delta)`` (0.0 before ``make_private`` and before the
    first step); Opacus's accuracy knobs (``eps_error``, ``delta_error``, ``alphas``) are accepted and unused:
    the epsilon is the engine's sound bound for its accountant. ``history``: Opacus's list of
    ``(noise_multiplier, sample_rate, num_steps)``, here one entry (the engine's noise multiplier, its
    sampling rate q = B / n, the steps taken), empty before the first step; it is a summary, not what the
    epsilon is computed from (banded and BLT noise and the DiceSGD family are accounted by their own
    theorems). ``mechanism()``: the name given to ``PrivacyEngine(accountant=)`` (``"prv"`` is served by the
    PLD accountant). ``state_dict()`` holds the engine's state (PRIVATE: the secret key of the batches and the
    noise; never release it); ``load_state_dict`` continues from it.

    Args:
        privacy_engine: Its ``PrivacyEngine`` (built there: use ``privacy_engine.accountant``).
        mechanism: The name given to ``PrivacyEngine(accountant=)``.
    """

    def __init__(self, privacy_engine: Any, mechanism: str) -> None:  # its ``PrivacyEngine`` (opacus.py)
        self._privacy_engine, self._mechanism = privacy_engine, mechanism

    # ------------------------------------------------------------------ what Opacus's accountants offer
    def mechanism(self) -> str:
        """The name given to ``PrivacyEngine(accountant=)``: ``"prv"``, ``"pld"`` or ``"rdp"``."""
        return self._mechanism

    @property
    def history(self) -> list[tuple[float, float, int]]:
        engine = self._privacy_engine.engine
        if engine is None or engine.steps_taken == 0:
            return []
        return [(float(engine.noise_multiplier), float(engine.sample_rate), int(engine.steps_taken))]

    @history.setter
    def history(self, value: Any) -> None:
        raise ConfigError("accountant.history is read from the engine (its settings and the steps it took) and "
                          "cannot be set; continue a training with accountant.load_state_dict(state)")

    def __len__(self) -> int:
        return len(self.history)

    def get_epsilon(self, delta: float, **kwargs: Any) -> float:
        """The engine's epsilon after the steps taken so far: ``PrivacyEngine.get_epsilon``.

        Args:
            delta: Delta, in (0, 1).
            **kwargs (Any): Opacus's accuracy knobs (``eps_error``, ``delta_error``, ...): accepted and unused.

        Returns:
            Epsilon at ``delta``; 0.0 before ``make_private`` and before the first step.

        Raises:
            ConfigError: ``delta`` outside (0, 1).
        """
        privacy.check_delta(delta)
        if self._privacy_engine.engine is None:
            return 0.0
        return self._privacy_engine.get_epsilon(delta)

    def get_privacy_spent(self, delta: float, alphas: Any = None) -> tuple[float, float]:
        """``(epsilon, best_alpha)`` as Opacus's ``RDPAccountant`` returns them.

        Args:
            delta: Delta, in (0, 1); it may be given by position, as Opacus's cifar10 example does.
            alphas: Accepted and unused (the orders are dp-accounting's).

        Returns:
            ``epsilon`` is ``get_epsilon``'s. ``best_alpha`` is the Renyi order whose conversion gives that
                epsilon where there is one: with ``accountant="rdp"`` on the subsampled Gaussian's accounting
                (DP-SGD and the algorithms accounted as it, with or without bands), recomputed and returned only
                when it reproduces the epsilon exactly; otherwise ``nan`` (no single order: the PLD accountant of
                ``"prv"``/``"pld"``, BLT noise, the DiceSGD family, and before the first step).
        """
        eps = self.get_epsilon(delta)
        return eps, self._best_alpha(delta, eps)

    def _best_alpha(self, delta: float, eps: float) -> float:
        engine = self._privacy_engine.engine
        if self._mechanism != "rdp" or engine is None or engine.steps_taken == 0 or not math.isfinite(eps):
            return math.nan
        spec = engine.spec
        if spec.kind != "gaussian" or spec.blt or engine.accountant != "rdp":
            return math.nan
        from dp_accounting import rdp as dp_rdp

        from ..privacy.accountants import SampledGaussian
        q, t = spec.rate_and_steps(engine.steps_taken)
        acc = dp_rdp.RdpAccountant()
        acc.compose(SampledGaussian(spec.noise_multiplier, q).event(t))
        got, order = acc.get_epsilon_and_optimal_order(delta)
        return float(order) if math.isclose(got, eps, rel_tol=1e-12, abs_tol=0.0) else math.nan

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Refused: the engine accounts each private step itself (``optimizer.step()``).

        Raises:
            ConfigError: always.
        """
        raise ConfigError("the engine accounts each private step itself (optimizer.step()); its accountant takes "
                          "no steps from outside")

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, destination: dict | None = None) -> dict:
        """The accountant's state. PRIVATE (it holds the secret key).

        Args:
            destination: A dict to fill (default: a new ``OrderedDict``).

        Returns:
            Opacus's ``{"history", "mechanism"}`` and, after ``make_private``, ``"privacy_engine"``: the
                ``PrivacyEngine.state_dict()`` a training continues from.
        """
        out = OrderedDict() if destination is None else destination
        out["history"], out["mechanism"] = self.history, self._mechanism
        if self._privacy_engine.engine is not None:
            out["privacy_engine"] = self._privacy_engine.state_dict()
        return out

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Continue a training from ``state_dict()`` (after a fresh ``make_private`` with the same settings).

        Args:
            state_dict: What ``state_dict()`` returned.

        Raises:
            ConfigError: an empty state; a state of another mechanism; one without the engine's state (an
                Opacus accountant's: it lacks the secret key and the sampler's position); one whose history
                disagrees with its engine state; one that accounts fewer steps than this engine has taken;
                a call before ``make_private``.
        """
        if not isinstance(state_dict, Mapping) or not state_dict:
            raise ConfigError("accountant.load_state_dict: the state is empty; pass what accountant.state_dict() "
                              "returned")
        missing = [k for k in ("history", "mechanism") if k not in state_dict]
        if missing:
            raise ConfigError(f"accountant.load_state_dict: the state has no {' or '.join(missing)}; pass what "
                              f"accountant.state_dict() returned")
        if state_dict["mechanism"] != self._mechanism:
            raise ConfigError(f"accountant.load_state_dict: a state of accountant {state_dict['mechanism']!r} "
                              f"cannot be loaded into one of {self._mechanism!r}: use "
                              f"PrivacyEngine(accountant={state_dict['mechanism']!r})")
        engine = self._privacy_engine.engine
        if engine is None:
            raise ConfigError("accountant.load_state_dict: call make_private (with the training's settings) first, "
                              "then load its state")
        saved = state_dict.get("privacy_engine")
        if not isinstance(saved, Mapping) or not isinstance(saved.get("engine"), Mapping):
            raise ConfigError("accountant.load_state_dict: the state holds no engine state (an Opacus accountant's "
                              "history alone cannot continue a clipbias training: it has no secret key and no "
                              "sampler position); pass what clipbias's accountant.state_dict() returned")
        steps = saved["engine"].get("steps_taken")
        try:
            counted = sum(int(entry[2]) for entry in state_dict["history"])
        except (TypeError, ValueError, IndexError, KeyError):
            counted = None
        if not isinstance(steps, int) or steps != counted:
            raise ConfigError(f"accountant.load_state_dict: the history counts {counted} step(s) but the engine "
                              f"state {steps!r}: the state was altered; pass what accountant.state_dict() returned")
        if steps < engine.steps_taken:
            raise ConfigError(f"accountant.load_state_dict: the state accounts {steps} step(s) but this engine has "
                              f"taken {engine.steps_taken}: loading it would report less privacy spent than was")
        self._privacy_engine.load_state_dict(saved)
