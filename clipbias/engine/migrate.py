"""Saved states of earlier clipbias versions, brought to the current layout in one place.

Two layouts carry a version, their ``"format"`` entry: ``DPEngine.state_dict()`` (``FORMAT``) and a run's
``checkpoint.pt`` (``CHECKPOINT_FORMAT``; its ``"engine"`` entry is an engine state with its own format).
``migrate`` (called first by ``DPEngine.load_state_dict``) and ``migrate_checkpoint`` (called by
``run.checkpoint.load_checkpoint``) take a state of any earlier format through the ordered steps
``STEPS`` / ``CHECKPOINT_STEPS``: step k brings format k to k + 1, filling in what that version added
(each step says why its value is the right one for the older state) or refusing, with the reason, a
state that cannot be resumed soundly. After them every loader reads the current format only. A state
of a newer format than this code's is refused.

An engine state without ``"format"`` is format 0: every state written before the version was recorded.
Those span several layouts, so the steps up to the first recorded format (7) test for the keys each
change added (a state written after the change already has them); a step added for a later change reads
a state whose format says its layout, and needs no such test. States from
before the secret key (format 0 without ``"secret_key"``) are refused by the first step, so the layouts
older than it (pipeline stages keyed by position, the row source's state under ``"grads"`` or absent)
need no step. A run checkpoint has always carried ``"format": 1``; its layouts up to the first format
that told them apart (7) are told apart the same way.

Recipe for a change of layout: bump ``FORMAT`` (or ``CHECKPOINT_FORMAT``), append one step, test it in
``tests/test_migrate.py`` (docs/architecture.md, "Checkpoint format and migrations").
"""

from __future__ import annotations

from typing import Any, Callable

from .. import algorithms
from ..errors import ConfigError, ResumeMismatchError
from ..privacy import MECHANISMS, dice
from .checks import optimizer_mismatch

TORCH_GENERATORS = ("cannot resume: this checkpoint comes from a clipbias version whose batches and noise came from "
                    "torch generators with 32-bit seeds, which can be recovered from the released model; continuing "
                    "it would not be private. Start a new run (a new run directory, or `overwrite=True`)")
SAMPLER_GENERATOR = ("this sampler state comes from a clipbias version whose batches were drawn by a torch generator "
                     "with a 32-bit seed (recoverable from the released model); it cannot be resumed: start a new run")
NOISE_GENERATOR = ("this noise state comes from a clipbias version whose noise was drawn by a torch generator with a "
                   "32-bit seed (recoverable from the released model); it cannot be resumed: start a new run")


# ---------------------------------------------------------------- DPEngine.state_dict()
def refuse_torch_generators(state: dict, engine: Any) -> None:
    """0 -> 1, the secret key (issue 24): the batches and the noise became ChaCha20 draws under a 256-bit
    key, saved as ``secret_key``, with the sampler's batch counter ``drawn`` and the noise stage's draw
    counter ``draws``. Before, they came from torch generators with 32-bit seeds, which can be recovered
    from the released model: continuing such a run would not be private, so it is refused, not migrated."""
    if "secret_key" not in state:
        raise ResumeMismatchError(TORCH_GENERATORS)
    if "drawn" not in state["sampler"]:
        raise ConfigError(SAMPLER_GENERATOR)
    noise = state["pipeline"].get("noise")
    if isinstance(noise, dict) and "draws" not in noise:
        raise ConfigError(NOISE_GENERATOR)


def one_band(state: dict, engine: Any) -> None:
    """1 -> 2, banded noise: the privacy settings and the sampler record ``bands``, the number of
    participation classes. Before, every run had one class (plain Poisson sampling, independent noise):
    ``bands`` 1 is what those runs were."""
    state["settings"].setdefault("bands", 1)
    state["sampler"].setdefault("bands", 1)


def record_optimizer_class(state: dict, engine: Any) -> None:
    """2 -> 3: the state records its base optimizer's class (``optimizer_class``), and a resume into another
    kind is refused (its moments or buffers mean nothing to the other). Before, the kind was told by the
    hyperparameters that mark a family (Adam's and AdamW's ``betas``, SGD's ``momentum``; the full set of
    names varies with torch's version): a state of the loading engine's family is recorded as its class (the
    engine built Adam, AdamW or SGD; Adam's and AdamW's states are alike), another family is refused."""
    if "optimizer_class" in state:
        return
    mine = type(engine.optimizer).__name__
    groups = state["optimizer"].get("param_groups") if isinstance(state["optimizer"], dict) else None

    def marks(gs: list[dict]) -> set[str]:
        return {k for g in gs for k in g if k in ("betas", "momentum")}
    if groups and marks(groups) != marks(engine.optimizer.param_groups):
        names = sorted({k for g in groups for k in g} - {"params"})
        raise optimizer_mismatch(f"another kind (hyperparameters {', '.join(names)})", mine)
    state["optimizer_class"] = mine


def count_undrawn_steps(state: dict, engine: Any) -> None:
    """3 -> 4, the Opacus interface: ``undrawn_steps`` counts the steps whose batch the engine's sampler did
    not draw (they make the run uncertified). The count starts with this format: the steps of an older
    state are counted as drawn (0), as that version reported them."""
    state.setdefault("undrawn_steps", 0)


def count_skipped_batches(state: dict, engine: Any) -> None:
    """4 -> 5: the sampler counts ``skipped``, the batches it drew that no step used (they make the run
    uncertified). An older sampler did not count them: 0, as that version reported its runs."""
    state["sampler"].setdefault("skipped", 0)


def taylor_strategy(state: dict, engine: Any) -> None:
    """5 -> 6, ``bands_strategy``: a banded noise state (it has ``coefs``) records the ``strategy`` of its
    coefficients. Before, the Taylor coefficients were the only ones: ``taylor``. A plain noise state (only
    ``draws``) is a one-band state and stays as it is."""
    noise = state["pipeline"].get("noise")
    if isinstance(noise, dict) and "coefs" in noise:
        noise.setdefault("strategy", "taylor")


def record_dropout_layouts(state: dict, engine: Any) -> None:
    """6 -> 7: the layouts of the keyed dropout calls (``randomness.forward``'s guard) travel with the state,
    so a resumed run is held to its first forward's. An older state recorded none: ``{}``, and the resumed
    run's first forward records them, as the guard did for that run before."""
    state.setdefault("dropout_layouts", {})


def one_noise_type(state: dict, engine: Any) -> None:
    """7 -> 8: the noise stage is one type whose plain case is one band (``step.GaussianNoise``), and it
    saves its coefficients, strategy and history whatever its bands: a plain noise state (only ``draws``)
    is the one-band state ``coefs`` [1.0], ``strategy`` taylor, no past inputs or outputs."""
    noise = state["pipeline"].get("noise")
    if isinstance(noise, dict) and "coefs" not in noise:
        noise.update(coefs=[1.0], strategy="taylor", inputs=[], outputs=[])


def count_transformed_steps(state: dict, engine: Any) -> None:
    """8 -> 9, one check of the drawn batch for every integration (``engine.drawn``): ``transformed_steps``
    counts the steps whose inputs or targets were not the batch the private loader drew (they make the run
    uncertified). Before, the engine did not count them (the Opacus interface kept its own count, beside
    the engine's state in ``PrivacyEngine.state_dict()``, and restores it from there): 0, as that version
    reported a run of the engine alone."""
    state.setdefault("transformed_steps", 0)


Step = Callable[[dict, Any], None]
STEPS: tuple[Step, ...] = (refuse_torch_generators, one_band, record_optimizer_class, count_undrawn_steps,
                           count_skipped_batches, taylor_strategy, record_dropout_layouts, one_noise_type,
                           count_transformed_steps)
FORMAT = len(STEPS)
"""The format ``DPEngine.state_dict()`` writes: a step per change, so the number of steps."""


def migrate(state: dict, engine: Any) -> dict:
    """``state`` (a ``DPEngine.state_dict()`` of any format up to ``FORMAT``) in the current format: a new
    dict (tensors shared), the caller's left as it was. ``engine``: the engine that loads it (the optimizer
    step reads its optimizer). Refuses a state that cannot be resumed soundly, and one of a newer format."""
    version = _version(state, "format", 0, FORMAT, "DPEngine state")
    out = _copy(state)
    for step in STEPS[version:]:
        step(out, engine)
    out["format"] = FORMAT
    return out


# ---------------------------------------------------------------- a run's checkpoint.pt
def dice_accounting_renamed(ckpt: dict) -> None:
    """1 -> 2: ``dice_accounting`` ``certified`` was renamed ``paper`` once a canary attack refuted the
    paper's bound (docs/privacy.md): a DiceSGD run from before records the refuted bound as certified. Its
    config names the bound ``paper`` and every record of its history says ``certified: false`` with the
    REFUTED basis, what this version reports for that accounting (and what its export releases)."""
    cfg = ckpt["config"]
    if cfg.get("dice_accounting") not in dice.RENAMED or cfg.get("algo") not in algorithms.ALGORITHMS or \
            not MECHANISMS.lookup(algorithms.get(cfg["algo"]).accounting).takes_basis:
        return
    cfg["dice_accounting"] = dice.RENAMED[cfg["dice_accounting"]]
    refuted = dice.REFUTED.format(basis=cfg["dice_accounting"])
    for rec in ckpt["history"]:
        rec.update(certified=False, basis=f"{rec.get('basis')}; {refuted}")


def per_rank_states(ckpt: dict) -> None:
    """2 -> 3, distributed training: the checkpoint records ``world_size`` and every rank's torch RNG
    state (``torch_rng_ranks``). An older checkpoint was written by one process: world size 1, its one
    torch RNG state the only rank's."""
    if "world_size" not in ckpt:
        ckpt["world_size"] = 1
    if "torch_rng_ranks" not in ckpt:
        ckpt["torch_rng_ranks"] = [ckpt["torch_rng"]]


def record_caveats(ckpt: dict) -> None:
    """3 -> 4, issue 24: each record of the history lists the ``caveats`` of its privacy statement (a seeded
    key, batches the sampler did not draw, ...). An older record named none: ``[]``, what that version
    stated (and exported) for the run."""
    for rec in ckpt["history"]:
        rec.setdefault("caveats", [])


def no_weight_average(ckpt: dict) -> None:
    """4 -> 5, ``ema``: a run may keep an exponential moving average of its weights (the config's ``ema``
    decay, the checkpoint's ``ema`` state). An older run kept none: ``ema`` None (a resume that asks for one
    is then refused as a changed setting: there is no average to continue)."""
    ckpt["config"].setdefault("ema", None)


def one_band_run(ckpt: dict) -> None:
    """5 -> 6, banded noise: the config records ``bands``. An older run had one participation class and
    independent noise: ``bands`` 1 (its engine state is migrated alike, ``one_band``)."""
    ckpt["config"].setdefault("bands", 1)


def taylor_run(ckpt: dict) -> None:
    """6 -> 7, ``bands_strategy``: the config records the strategy of the banded noise's coefficients. Before,
    the Taylor coefficients were the only ones: ``taylor`` (its engine state is migrated alike,
    ``taylor_strategy``)."""
    ckpt["config"].setdefault("bands_strategy", "taylor")


TORCH_GENERATOR_CAVEAT = ("the run's batches and noise came from torch generators with 32-bit seeds, which can be "
                          "recovered from the released model: no privacy guarantee holds (a clipbias version before "
                          "the secret key)")


def seeded_runs_uncertified(ckpt: dict) -> None:
    """7 -> 8: a run whose engine state has no ``secret_key`` drew its batches and noise from torch generators
    with 32-bit seeds (before the secret key, issue 24), which can be recovered from the released model, so
    none of its statements holds: every record says ``certified: false`` with that caveat. Its version said
    certified, and an export of it released that claim; the engine already refuses to resume it
    (``refuse_torch_generators``)."""
    engine = ckpt.get("engine")
    if not (isinstance(engine, dict) and engine and "secret_key" not in engine):
        return
    for rec in ckpt["history"]:
        if rec.get("certified"):
            rec.update(certified=False, caveats=[*rec["caveats"], TORCH_GENERATOR_CAVEAT])


CHECKPOINT_STEPS: tuple[Callable[[dict], None], ...] = (dice_accounting_renamed, per_rank_states, record_caveats,
                                                        no_weight_average, one_band_run, taylor_run,
                                                        seeded_runs_uncertified)
CHECKPOINT_FORMAT = 1 + len(CHECKPOINT_STEPS)
"""The format of the checkpoint.pt a run writes (its first format was 1)."""


def migrate_checkpoint(ckpt: dict) -> dict:
    """A run's checkpoint (``run.checkpoint.load_checkpoint``) of any format up to ``CHECKPOINT_FORMAT`` in
    the current one: a new dict (tensors shared). Its ``"engine"`` entry is migrated when an engine loads it."""
    version = _version(ckpt, "format", 1, CHECKPOINT_FORMAT, "run checkpoint")
    out = _copy(ckpt)
    for step in CHECKPOINT_STEPS[version - 1:]:
        step(out)
    out["format"] = CHECKPOINT_FORMAT
    return out


def _version(state: dict, key: str, oldest: int, current: int, what: str) -> int:
    """The format of ``state`` (absent: ``oldest``), refused if it is not one this code reads."""
    version = state.get(key, oldest)
    if isinstance(version, bool) or not isinstance(version, int) or version < oldest:
        raise ConfigError(f"not a {what}: its format is {version!r}; pass what clipbias saved")
    if version > current:
        raise ResumeMismatchError(f"cannot resume: this {what} has format {version}, written by a newer clipbias "
                                  f"version (this one reads formats up to {current}). Resume it with that "
                                  f"version, or start a new run")
    return version


def _copy(node: Any) -> Any:
    """A copy of the dicts and lists of a saved state; tensors and other leaves shared."""
    if isinstance(node, dict):
        return {k: _copy(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_copy(v) for v in node]
    return node
