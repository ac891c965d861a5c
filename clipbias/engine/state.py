"""A ``DPEngine``'s private state: what ``state_dict`` saves and ``load_state_dict`` restores (the
step counters, optimizer, pipeline, sampler, row source and secret key), all or nothing, after the
checks that a resumed run is the same private run (``checks.check_resume``)."""

from __future__ import annotations

import copy
from dataclasses import asdict
from typing import Any

from ..errors import ConfigError
from ..randomness import SecretKey
from .checks import check_optimizer_resume, check_resume
from .migrate import FORMAT, migrate


def state_of(engine: Any) -> dict:
    """All DP state of ``engine`` except the model weights. PRIVATE: never release it."""
    return {"format": FORMAT, "settings": asdict(engine.settings), "steps_taken": engine.steps_taken,
            "undrawn_steps": engine.undrawn_steps, "transformed_steps": engine.transformed_steps,
            "unproven_steps": engine.unproven_steps,
            "optimizer": engine.optimizer.state_dict(), "optimizer_class": type(engine.optimizer).__name__,
            "pipeline": engine.pipeline.state_dict(),
            "sampler": _sampler_state(engine), "secret_key": engine.key.state_dict(),
            "rows": engine.rows.state_dict(), "dropout_layouts": copy.deepcopy(engine._dropout_layouts),
            "fetch_caveats": dict(getattr(engine, "fetch_caveats", {}))}  # (sampling.refetch; absent before: none)


def _sampler_state(engine: Any) -> dict:
    """The sampler's state, with the batch it handed out last and no step has used (a loop that stopped
    after fetching it) first among the batches drawn ahead: the resumed run steps on it next."""
    state = engine.sampler.state_dict()
    if engine.sampler.last is not None:
        state["ahead"] = [engine.sampler.last.clone()] + state["ahead"]
    return state


def load(engine: Any, state: dict) -> None:
    """``engine`` continues from ``state`` (``DPEngine.load_state_dict``), or is left as it was."""
    missing = [k for k in ("settings", "steps_taken", "optimizer", "pipeline", "sampler")
               if not isinstance(state, dict) or k not in state]
    if missing:
        raise ConfigError(f"load_state_dict: not a DPEngine state ({', '.join(missing)} missing); pass what "
                          f"DPEngine.state_dict() returned (a checkpoint's 'engine' entry)")
    state = migrate(state, engine)  # an older format's state in the current one (engine.migrate), or refused
    check_resume(state["settings"], asdict(engine.settings))
    check_optimizer_resume(state, engine.optimizer)
    if engine.steps_taken:
        raise ConfigError(f"load_state_dict: this engine has taken {engine.steps_taken} step(s); loading a state "
                          f"into it would replay draws it has already released. Build a new DPEngine and load "
                          f"the state into that")
    backup = state_of(engine)
    try:
        _load(engine, state)
    except Exception:
        _load(engine, backup)  # the engine as it was, on its own key
        raise


def _load(engine: Any, state: dict) -> None:
    key = SecretKey.from_state(state["secret_key"])  # the stream continues under the run's key
    key.adopt(engine)
    set_key(engine, key)
    engine.steps_taken = state["steps_taken"]
    engine.undrawn_steps = state["undrawn_steps"]
    engine.transformed_steps = state["transformed_steps"]
    engine.unproven_steps = state.get("unproven_steps", 0)  # (absent before the loop's own loss was followed)
    engine.optimizer.load_state_dict(state["optimizer"])
    engine.pipeline.load_state_dict(state["pipeline"])
    noise = engine.pipeline.noise
    if noise is not None and noise.strategy == "blt":  # a resumed BLT run is accounted with its saved strategy
        engine.plan = engine.plan.with_strategy(noise.blt)
    engine.sampler.load_state_dict(state["sampler"])
    engine.rows.load_state_dict(state["rows"])
    engine.fetch_caveats = dict(state.get("fetch_caveats", {}))  # what the loader's re-fetch check saw so far
    engine._dropout_layouts = copy.deepcopy(state["dropout_layouts"])  # the keyed dropout calls' layouts so far


def set_key(engine: Any, key: SecretKey) -> None:
    """Every secret draw of the run under ``key``: sampler, row source, keyed stages (noise, perturbation)."""
    engine.key = engine.rows.key = engine.sampler.key = key
    for _, stage in engine.pipeline.named_stages():
        if isinstance(getattr(stage, "key", None), SecretKey):
            stage.key = key
