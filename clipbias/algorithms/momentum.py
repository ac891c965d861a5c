"""Momentum inside the clip (Xiao, Xiang, Wang, Devadas, Section 4).

* ``PerExampleMomentum`` (Alg. 1, DP-GD with momentum): one buffer per training example,
  ``m_i <- gamma_m g_i + (1 - gamma_m) m_i`` (``m_i = g_i`` the first time), then clip/normalise.
  Full batch (q = 1); memory O(N d).
* ``InnerMomentumGradients`` (Alg. 2, inner momentum, eq. (13)): for a sampled example,
  ``m_i = sum_{j=0..K0} gamma0^j grad f(w_{k-1-j}, x_i)`` over the current and the K0 stored past
  iterates (fewer at the start); only K0 parameter snapshots are stored.
* ``OuterMomentum`` (eq. (14)): ``M_k = (1 - gamma1) M_{k-1} + (G_k + noise)``, applied after the
  noise (post-processing of the released update), then ``w_k = w_{k-1} - lr M_k``.

Privacy: every row is a function of one example and of *released* iterates only, so after the clip
(or normalisation) one example changes the summed rows by at most C (or 1): the ordinary Gaussian
mechanism per step, composed T times (q = 1 for Alg. 1, Poisson rate q for Alg. 2).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from ..data import batch
from .. import distributed
from ..config import OPTIONAL, AlgoConfig, Setting, boolean, integer, real
from ..errors import ConfigError
from ..grads.rows import FuncGradients, LossFn, PerExampleRows, RowSource
from ..randomness import forward
from ..step import Carried, PerSample, StepContext
from .base import Algorithm, Parts, clip_or_normalize, register


# ---------------------------------------------------------------- memory
def available_memory_bytes(device: torch.device | str = "cpu") -> int | None:
    """Free memory on ``device`` (CUDA: ``mem_get_info``; CPU: ``MemAvailable``), None if unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except OSError:
        pass
    if free is None:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pass
    cgroup = _cgroup_free_bytes()  # a container's limit can be below the machine's free memory
    if cgroup is not None:
        free = cgroup if free is None else min(free, cgroup)
    return free


def _cgroup_free_bytes() -> int | None:
    for limit_f, usage_f in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                             ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                              "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_f) as f:
                raw = f.read().strip()
            with open(usage_f) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if raw == "max" or int(raw) >= 1 << 60:
            return None
        return max(0, int(raw) - usage)
    return None


def momentum_memory_bytes(n: int, d: int, bytes_per_float: int = 4) -> int:
    """Peak memory of Alg. 1's state: the N x d buffer plus one step's staged N x d copy."""
    return 2 * n * d * bytes_per_float


def check_momentum_memory(n: int, d: int, device: torch.device | str = "cpu",
                          limit_gb: float | None = None) -> None:
    """Refuse, before training, a per-example momentum buffer that will not fit."""
    need = momentum_memory_bytes(n, d)
    have = int(limit_gb * 2**30) if limit_gb is not None else available_memory_bytes(device)
    if have is not None and need > 0.9 * have:
        what = f"the limit `AlgoConfig.extra['max_memory_gb']={limit_gb:g}`" if limit_gb is not None else \
            f"only {have / 2**30:.1f} GB is available on {torch.device(device)}"
        raise ConfigError(
            f"dpgd-momentum stores one momentum vector per training example: N={n} x d={d} floats plus "
            f"one step's staged copy need {need / 2**30:.1f} GB, but {what}. Train on fewer examples "
            f"(a subset), use a smaller model, or use `algo='inner-outer'` (memory O(K0 d)).")


# ---------------------------------------------------------------- Alg. 1
class PerExampleMomentum(PerSample):
    """Per-example momentum of Alg. 1 (line 7), keyed by example index; ``bound = None``.

    The new buffers of a step are staged and written by ``commit()`` (so a failed step leaves them
    unchanged); the buffer is PRIVATE state, saved in ``state_dict`` (checkpoints are private).
    """

    bound = None

    def __init__(self, n: int, gamma_m: float) -> None:
        if not 0 < gamma_m <= 1:
            raise ConfigError(f"`AlgoConfig.extra['gamma_m']` (Alg. 1 momentum weight of the new gradient) must lie in (0, 1], "
                              f"got {gamma_m!r}")
        self.n, self.gamma = int(n), float(gamma_m)
        self.buf: Tensor | None = None
        self.seen: Tensor | None = None
        self._pending: list[tuple[Tensor, Tensor]] = []

    def momentum(self, g: Tensor, idx: Tensor) -> Tensor:
        """The new momenta of examples ``idx`` given their gradients ``g`` (pure)."""
        if self.buf is None:
            return g.clone()
        idx = idx.to(self.buf.device)
        prev, seen = self.buf[idx].to(g), self.seen[idx].to(g.device).unsqueeze(1)
        return torch.where(seen, self.gamma * g + (1 - self.gamma) * prev, g)

    def __call__(self, g: Tensor, ctx: StepContext) -> Tensor:
        if ctx.indices is None:
            raise ConfigError("dpgd-momentum keeps one momentum buffer per training example and needs "
                              "the example indices: use engine.train_epoch(x, y) or engine.step(x, y, indices)")
        idx = ctx.indices
        if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= self.n):
            raise ConfigError(f"example index out of range [0, {self.n}): dpgd-momentum's buffers are "
                              f"for the N={self.n} training examples the engine was built for")
        m = self.momentum(g, idx)
        self._pending.append((idx, m))
        return m

    def commit(self) -> None:
        if not self._pending:
            return
        d = self._pending[0][1].shape[1]
        if self.buf is None:
            dev = self._pending[0][1].device
            try:
                self.buf = torch.zeros(self.n, d, device=dev)
                self.seen = torch.zeros(self.n, dtype=torch.bool, device=dev)
            except RuntimeError as err:  # out of memory
                raise ConfigError(f"cannot allocate dpgd-momentum's N x d = {self.n} x {d} buffer ({err}); "
                                  f"use fewer examples, a smaller model, or `algo='inner-outer'`") from err
        for idx, m in self._pending:
            idx = idx.to(self.buf.device)
            self.buf[idx] = m.to(self.buf)
            self.seen[idx] = True
        self._pending = []

    def rollback(self) -> None:
        self._pending = []

    def probe(self, g: Tensor, ctx: StepContext) -> Tensor:
        """The momenta the probe examples would get (needs their *training* indices: the buffers
        belong to them); nothing is staged."""
        if ctx.indices is None:
            raise ConfigError("measuring dpgd-momentum's clipped quantity needs the training indices "
                              "of the probe examples (their momentum buffers)")
        return self.momentum(g, ctx.indices)

    def state_dict(self) -> dict:
        """The buffers of every example. In a process group each rank updates the rows of the examples
        it owns (index % world) and this gathers them: a collective, every rank calls it."""
        buf, seen = distributed.merge_owned(self.buf, self.seen, self.n)
        return {"buf": None if buf is None else buf.clone(), "seen": None if seen is None else seen.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.buf, self.seen = state["buf"], state["seen"]
        self._pending = []


# ---------------------------------------------------------------- Alg. 2
class InnerMomentumGradients(RowSource):
    """Rows ``m_i = sum_{j=0..J} gamma0^j grad f(w_{k-1-j}, x_i)``, J = min(K0, iterates stored).

    ``history`` holds the past iterates, newest first (``w_{k-2}, w_{k-3}, ...``), at most K0 of
    them; ``commit()`` (called by the engine after a successful step) pushes the iterate the step
    started from. The iterates are released model states, so storing them costs no privacy; the
    history is in ``state_dict`` so that a resumed run is exact.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, k0: int, gamma0: float) -> None:
        self.fg = FuncGradients(model, loss_fn)
        self.layout = self.fg.layout
        self.k0, self.gamma0 = int(k0), float(gamma0)
        self.history: list[dict[str, Tensor]] = []
        self._pending: dict[str, Tensor] | None = None

    def inner(self, x: Tensor, y: Tensor, now: dict[str, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """Inner momenta of ``(x, y)`` at the current iterate (or ``now``) and the stored past ones."""
        m, losses = self.fg(x, y, now)
        for j, past in enumerate(self.history[:self.k0], start=1):
            g, _ = self.fg(x, y, past)
            m = m + self.gamma0 ** j * g
        return m, losses

    def probe(self, x: batch.Batch, y: batch.Batch, max_physical_batch: int = 512) -> Tensor:
        """Inner momenta of the probe batch at the current and stored iterates; nothing staged."""
        parts = [self.inner(batch.take(x, slice(s, s + max_physical_batch)),
                            batch.take(y, slice(s, s + max_physical_batch)))[0]
                 for s in range(0, batch.size(x), max_physical_batch)]
        return torch.cat(parts) if parts else torch.zeros(0, self.layout.dim)

    def iter_rows(self, x: Tensor, y: Tensor, indices: Tensor | None, step: int,
                  max_physical_batch: int) -> Iterator[tuple[Tensor, Tensor, Tensor | None]]:
        now = {k: v.clone() for k, v in self.fg.params().items()}
        self._pending = now
        for start in range(0, batch.size(x), max_physical_batch):
            sl = slice(start, start + max_physical_batch)
            with forward.examples(indices[sl] if indices is not None else None):  # the same masks at every iterate
                m, losses = self.inner(batch.take(x, sl), batch.take(y, sl), now)
            yield m, losses, (indices[sl] if indices is not None else None)

    def commit(self) -> None:
        if self._pending is not None and self.k0 > 0:
            self.history = [self._pending, *self.history][:self.k0]
        self._pending = None

    def rollback(self) -> None:
        self._pending = None

    def state_dict(self) -> dict:
        return {"k0": self.k0, "gamma0": self.gamma0,
                "history": [{k: v.clone() for k, v in h.items()} for h in self.history]}

    def load_state_dict(self, state: dict) -> None:
        if state["k0"] != self.k0 or state["gamma0"] != self.gamma0:
            raise ConfigError(f"cannot resume inner-outer: checkpoint has K0={state['k0']}, "
                              f"gamma0={state['gamma0']} but now K0={self.k0}, gamma0={self.gamma0}; "
                              f"resume with the original `AlgoConfig.extra['K0']` and `AlgoConfig.extra['gamma0']`")
        dev = {k: v.device for k, v in self.fg.params().items()}  # checkpoints are saved on the CPU
        self.history = [{k: v.to(dev[k]) for k, v in h.items()} for h in state["history"]]
        self._pending = None


class OuterMomentum(Carried):
    """Eq. (14): ``M_k = (1 - gamma1) M_{k-1} + v_k`` on the *noisy* update ``v_k`` (M_0 = 0)."""

    KEY = "m"  # M_k
    m: Tensor | None

    def __init__(self, gamma1: float) -> None:
        if not 0 < gamma1 <= 1:
            raise ConfigError(f"`AlgoConfig.extra['gamma1']` (outer momentum, eq. (14)) must lie in (0, 1], got {gamma1!r}")
        self.gamma1 = float(gamma1)
        super().__init__()

    def __call__(self, v: Tensor) -> Tensor:
        m = v if self.m is None else (1 - self.gamma1) * self.m.to(v.device) + v  # .to: CPU checkpoints
        self._pending = m
        return m


# ---------------------------------------------------------------- registration
GAMMA_M = Setting("gamma_m", 0.1, "a number in (0, 1]", real(0, 1, lo_open=True), "--gamma-m", float,
                  "dpgd-momentum: Alg. 1's momentum weight of the new gradient")
NORMALIZE = Setting("normalize", False, "true or false", boolean, "--normalize-momentum",
                    help="normalise m/(||m|| + gamma) (the paper's choice) "
                         "instead of clipping to C")
MAX_MEM = Setting("max_memory_gb", OPTIONAL, "a number > 0", real(0, float("inf"), lo_open=True),
                  "--max-memory-gb", float, "memory limit for the per-example buffers "
                                            "(default: free RAM)")
K0 = Setting("K0", 2, "an integer >= 0", integer(0), "--k0", help="past iterates in the inner momentum",
             aliases=("k0",))
GAMMA0 = Setting("gamma0", 0.08, "a number in [0, 1]", real(0, 1), "--gamma0", float, "inner momentum decay")
GAMMA1 = Setting("gamma1", 0.9, "a number in (0, 1]", real(0, 1, lo_open=True), "--gamma1", float,
                 "inner-outer: outer momentum M_k = (1 - gamma1) M_{k-1} + G_k + noise")


def _bound(cfg: AlgoConfig, s: dict) -> str:
    return "1 (normalised)" if s["normalize"] else f"{cfg.clip:g} (clip C)"


def _full_batch(cfg: AlgoConfig, s: dict, q: float, batch_size: float) -> None:
    if q != 1:
        n = batch_size / q
        raise ConfigError(f"dpgd-momentum is full-batch DP-GD (Xiao et al. Alg. 1): every step uses all N "
                          f"examples. Set `batch_size` to N = {n:.0f} (sample rate 1), or use `algo='inner-outer'` "
                          f"for a subsampled momentum method.")


def _momentum_source(model: nn.Module, loss_fn: LossFn, cfg: AlgoConfig, s: dict, *, n: int,
                     batch_size: float, key) -> RowSource:
    fg = FuncGradients(model, loss_fn)
    check_momentum_memory(n, fg.layout.dim, next(model.parameters()).device, s["max_memory_gb"])
    return PerExampleRows(fg)


register(Algorithm(
    "dpgd-momentum", "DP-GD with per-example momentum (Xiao et al. Alg. 1), full batch", True, "gaussian",
    lambda cfg, s, b, key: Parts([PerExampleMomentum(round(b), s["gamma_m"]), clip_or_normalize(cfg, s["normalize"])]),
    schema=(GAMMA_M, NORMALIZE, MAX_MEM), source=_momentum_source, validate=_full_batch,
    note=lambda cfg, s: (
        f"per-example L2 sensitivity {_bound(cfg, s)}; full batch (q = 1): each step releases sum_i clip(m_i) "
        f"+ noise, where m_i mixes only example i's own gradients at released iterates; T-fold composition "
        f"of the Gaussian mechanism, T = number of full-batch steps")))


def _inner_outer_checks(cfg: AlgoConfig, s: dict, q: float, batch_size: float) -> None:
    if cfg.momentum:
        raise ConfigError(f"inner-outer applies its own outer momentum M_k = (1 - gamma1) M_(k-1) + G_k + "
                          f"noise (eq. (14)); set `AlgoConfig.momentum=0` (got {cfg.momentum}) and choose "
                          f"`AlgoConfig.extra['gamma1']`")
    if (cfg.optimizer or "sgd") != "sgd":
        raise ConfigError(f"inner-outer updates w_k = w_(k-1) - lr M_k (Alg. 2 line 8): use `AlgoConfig.optimizer='sgd'`, "
                          f"got {cfg.optimizer!r}")


register(Algorithm(
    "inner-outer", "DP-SGD with inner and outer momentum (Xiao et al. Alg. 2)", True, "gaussian",
    lambda cfg, s, b, key: Parts([clip_or_normalize(cfg, s["normalize"])], post=OuterMomentum(s["gamma1"])),
    schema=(K0, GAMMA0, GAMMA1, NORMALIZE),
    source=lambda model, loss_fn, cfg, s, *, n, batch_size, key: InnerMomentumGradients(
        model, loss_fn, s["K0"], s["gamma0"]),
    validate=_inner_outer_checks,
    note=lambda cfg, s: (
        f"per-example L2 sensitivity {_bound(cfg, s)}; each sampled example contributes clip(m_i) with m_i = "
        f"sum_j {s['gamma0']:g}^j grad f(w_(k-1-j), x_i), j <= K0={s['K0']}: its own gradients at released "
        f"iterates only; the outer momentum is post-processing of the noisy releases")))
