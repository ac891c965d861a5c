"""``TrainConfig``: everything one run depends on, valid by construction (each error names its
flag), so nothing downstream checks it again. Field names are the CLI flags with ``-`` -> ``_``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import algorithms, privacy
from ..config import AlgoConfig
from ..data.catalog import DATASETS
from ..errors import ConfigError
from ..files import new_run_dir
from ..privacy.report import check_delta, check_epsilon, check_nonnegative, check_positive
from ..randomness import check_seed

# Settings that may differ on --resume (they do not change the math or the privacy statement).
RESUME_FREE = {"out", "resume", "overwrite", "max_physical_batch", "eval_batch_size", "data_dir", "grad_path"}


@dataclass(frozen=True)
class TrainConfig:
    """Everything one run depends on. Field names are the CLI flags with ``-`` -> ``_``.

    ``batch_size`` is the *expected* Poisson batch size B (q = B / N). Private algorithms need
    ``epsilon`` (the engine calibrates the noise multiplier) or ``noise_multiplier``; non-private
    ones ignore both and report epsilon = inf. ``subset`` makes the private data set the first K training
    examples (it defines the data: K is public, and N = K is what the accounting uses). ``validation``
    carves a validation part out of the training data: each example with probability K/N, by a keyed
    draw under the run's secret key (so K is the expected size; not stratified; ``run.splits``).
    ``split_seed`` only picks which public *test* images become public features. ``extra`` holds method-specific
    hyper-parameters (the ``Setting`` keys of the algorithms: ``k``, ``p``, ``K``, ``K0``, ``gamma0``,
    ``gamma1``, ``public_size``, ...), only those given; the algorithm validates them. ``batch-clip`` takes ``public_size`` public features from the test split (removed from
    evaluation; ``public_source="test"``) or held out of the training split by keyed draws (``"holdout"``, N
    shrinks; private data used unprotected, so the run is not certified).
    ``ema`` (a decay in (0, 1)) keeps an exponential moving average of the weights (post-processing,
    ``run.average``), evaluated, reported and exported beside the raw weights.
    """

    data: str = "fashion-mnist"
    model: str = "cnn"
    algo: str = "dpsgd"
    epsilon: float | None = None
    delta: float = 1e-5
    epochs: int = 1
    batch_size: float = 256.0
    lr: float = 0.1
    clip: float = 1.0
    ef_clip: float | None = None
    grad_bound: float | None = None
    accountant: str = "pld"
    dice_accounting: str = privacy.DEFAULT_DICE_ACCOUNTING
    noise_multiplier: float | None = None
    seed: int = 0
    reproducible_noise: bool = False
    noise_seed: int | None = None
    device: str = "cpu"
    optimizer: str | None = None
    momentum: float = 0.0
    weight_decay: float = 0.0
    gamma: float = 0.01
    max_physical_batch: int = 512
    grad_path: str = "auto"
    validation: int = 0
    subset: int | None = None
    split_seed: int = 0
    public_source: str = "test"
    extra: dict = field(default_factory=dict)
    out: str | None = None
    resume: bool = False
    overwrite: bool = False
    eval_batch_size: int = 1024
    data_dir: str | None = None
    data_path: str | None = None
    ema: float | None = None
    bands: int = 1
    bands_strategy: str = "taylor"

    @property
    def private(self) -> bool:
        return algorithms.get(self.algo).private

    @property
    def basis(self) -> privacy.DiceBasis:
        """The error-feedback accounting basis the setting names (checked when the config was made)."""
        return privacy.dice.basis(self.dice_accounting)

    @property
    def strategy(self):
        """The ``algorithms.bands.NoiseStrategy`` the setting names (checked when the config was made)."""
        from ..algorithms.bands import noise_strategy
        return noise_strategy(self.bands_strategy)

    @property
    def key_seed(self) -> int | None:
        """The seed of the run's secret key: ``noise_seed``, else ``seed`` with ``reproducible_noise``,
        else None (a fresh key from the OS CSPRNG)."""
        if not self.reproducible_noise:
            return None
        return self.noise_seed if self.noise_seed is not None else self.seed

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def algo_config(self) -> AlgoConfig:
        return AlgoConfig(lr=self.lr, clip=self.clip, ef_clip=self.ef_clip, grad_bound=self.grad_bound,
                          gamma=self.gamma, optimizer=self.optimizer, momentum=self.momentum,
                          weight_decay=self.weight_decay, extra=dict(self.extra))

    def __post_init__(self) -> None:
        """Every check that needs no data, once, where the config is made (``dataclasses.replace``
        makes a new one and checks it again); each error names the field (the CLI names its flag)."""
        if self.data not in DATASETS:
            raise ConfigError(f"`data` must be one of {', '.join(DATASETS)}, got {self.data!r}")
        from ..models import MODEL_NAMES
        if self.model not in MODEL_NAMES:
            raise ConfigError(f"`model` must be one of {', '.join(MODEL_NAMES)}, got {self.model!r}")
        algo = algorithms.get(self.algo)
        if self.epsilon is not None:
            check_epsilon(self.epsilon, "epsilon")
        if self.noise_multiplier is not None:
            check_positive(self.noise_multiplier, "noise_multiplier")
        check_delta(self.delta, "delta")
        if algo.private:
            if self.epsilon is None and self.noise_multiplier is None:
                raise ConfigError(f"`epsilon` is required for the private `algo='{self.algo}'` "
                                  f"(or give `noise_multiplier`)")
            if self.epsilon is not None and self.noise_multiplier is not None:
                raise ConfigError("give either `epsilon` or `noise_multiplier`, not both")
        check_int(self.epochs, "epochs", 1)
        check_positive(self.batch_size, "batch_size")
        if self.batch_size < 1:
            raise ConfigError(f"`batch_size` is the expected Poisson batch size B and must be >= 1, got "
                              f"{self.batch_size!r} (B < 1 would mean more steps per epoch than examples)")
        check_positive(self.lr, "lr")
        check_positive(self.clip, "clip")
        if self.ef_clip is not None:
            check_positive(self.ef_clip, "ef_clip")
            if not algo.reads_ef_clip:  # it would be recorded but change nothing
                takers = ", ".join(n for n, a in algorithms.ALGORITHMS.items() if a.reads_ef_clip)
                raise ConfigError(f"`ef_clip` applies to the clipped error-feedback algorithms ({takers}); "
                                  f"`algo='{self.algo}'` has no clipped feedback buffer: drop `ef_clip`")
        if self.grad_bound is not None:
            check_positive(self.grad_bound, "grad_bound")
        check_positive(self.gamma, "gamma")
        if not (math.isfinite(self.momentum) and 0 <= self.momentum < 1):
            raise ConfigError(f"`momentum` must lie in [0, 1), got {self.momentum!r}")
        check_nonnegative(self.weight_decay, "weight_decay")
        if self.optimizer is not None and self.optimizer not in ("sgd", "adam", "adamw"):
            raise ConfigError(f"`optimizer` must be one of sgd, adam, adamw, got {self.optimizer!r}")
        if self.accountant not in privacy.ACCOUNTANTS:
            raise ConfigError(f"`accountant` must be one of {', '.join(privacy.ACCOUNTANTS)}, "
                              f"got {self.accountant!r}")
        privacy.dice.check_basis(self.dice_accounting)
        check_int(self.seed, "seed", 0)
        if self.seed >= 1 << 64:
            raise ConfigError(f"`seed` (the model initialisation's seed) must be below 2^64, got {self.seed!r}; a "
                              f"longer secret seed for the batches and noise goes to `noise_seed` (a reproducible run)")
        if self.noise_seed is not None:
            if not self.reproducible_noise:
                raise ConfigError("`noise_seed` is only used with `reproducible_noise=True`")
            check_seed(self.noise_seed)
        check_int(self.split_seed, "split_seed", 0)
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"`device` must be cpu or cuda, got {self.device!r}")
        check_int(self.max_physical_batch, "max_physical_batch", 1)
        if self.grad_path not in ("rows", "fast", "auto"):
            raise ConfigError(f"`grad_path` must be rows, fast or auto, got {self.grad_path!r}")
        check_int(self.eval_batch_size, "eval_batch_size", 1)
        check_int(self.validation, "validation", 0)
        if self.ema is not None:
            from .average import check_decay
            check_decay(self.ema)
        _check_bands(self.bands, self.algo, self.bands_strategy)
        if self.subset is not None:
            check_int(self.subset, "subset", 1)
        given = {k: v for k, v in self.extra.items() if v is not None}
        if given and not algo.schema:  # core algorithms read no method setting
            flags = ", ".join(f"`AlgoConfig.extra['{k}']`" for k in given)
            disk = f" (kappa and disk_gamma are DiSK's: use `algo='{self.algo}+disk'` or `algo='disk'`)" if \
                {"kappa", "disk_gamma", "kf_gamma"} & set(given) else ""
            takers = ", ".join(n for n, a in algorithms.ALGORITHMS.items() if a.schema)
            raise ConfigError(f"{flags} {'does' if len(given) == 1 else 'do'} not apply to `algo='{self.algo}'`; the method settings are for "
                              f"the algorithms that take them ({takers}){disk}")
        if "public_size" in given:
            check_int(given["public_size"], "public_size", 1)
        if self.public_source not in ("test", "holdout"):
            raise ConfigError(f"`public_source` must be test or holdout, got {self.public_source!r}")
        if given:  # the method's own checks (each message names the flag)
            algo.settings(self.algo_config_without_public() if algo.needs_public else self.algo_config())

    def algo_config_without_public(self) -> AlgoConfig:
        """For validation before the public features exist: a placeholder tensor."""
        return dataclasses.replace(self.algo_config(), extra={**self.extra, "public": torch.zeros(1, 1)})


def check_int(v: Any, name: str, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ConfigError(f"`{name}` must be an integer >= {minimum}, got {v!r}")
    return v


def default_out(cfg: TrainConfig) -> str:
    """A new run directory ``runs/<data>-<model>-<algo>-eps<E>-s<seed>-<date>-<time>``, created now
    (``epsinf`` for non-private algorithms; ``files.new_run_dir``): runs without ``--out`` never share one."""
    eps = f"{cfg.epsilon:g}" if (cfg.private and cfg.epsilon is not None) else (
        f"z{cfg.noise_multiplier:g}" if cfg.private else "inf")
    return str(new_run_dir(f"{cfg.data}-{cfg.model}-{cfg.algo}-eps{eps}-s{cfg.seed}"))


def _check_bands(bands: int, algo: str, strategy: str) -> None:
    """``--bands``: a whole number >= 1, more than 1 only for the algorithms banded noise is accounted for;
    ``--bands-strategy``: one of ``bands.NOISE_STRATEGIES``."""
    from ..algorithms.bands import check_strategy
    check_int(bands, "bands", 1)
    check_strategy(strategy)
    if bands > 1:
        algorithms.get(algo).check_bands(bands)
