"""Fixed-seed runs of every algorithm, reduced to exact numbers (the behaviour-identity check).

``numbers(algo)`` trains one small ``--reproducible-noise`` run (digits, 2 epochs, B = 128, the
noise multiplier fixed so no calibration runs) and returns every number of its results.json that
does not measure time, plus a SHA-256 of the final model weights and of the private engine state.
``tests/data/behaviour.json`` holds these numbers as produced before the one-step redesign (issue
13); ``tests/test_behaviour.py`` asserts that every algorithm still gives them bit for bit.

Regenerate (only when a change is *meant* to change results, and say so in the commit):
``python -m tests.behaviour > tests/data/behaviour.json``. A new method adds only its numbers:
``python -m tests.behaviour --add NAME`` runs it and writes it into ``tests/data/behaviour.json``, every
other case untouched; made on another machine than the file's, the case records its own ``fingerprint``
(its bit-for-bit machine). A method runs the default case (digits, an MLP, 2 epochs, its own default
settings) unless ``CASES`` gives it other settings.

Float results depend on the machine's kernels (SIMD width, BLAS build): the golden file records the
machine it was made on (``fingerprint``). On that machine the check is bit for bit; elsewhere it
compares the same numbers within tolerances that float rounding cannot exceed but a changed formula
does (``tests/test_behaviour.py``), and the exact-valued state (RNG states, counters) still bit for bit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pathlib
import platform
import sys
import tempfile

import torch

CASES: dict[str, dict] = {  # the settings of a method's case where the defaults do not suit it (default: {})
    "sgd": {}, "clip-sgd": {}, "ef-sgd": {}, "dpsgd": {}, "normalized": {"lr": 0.2},
    "dice": {}, "dice-adam": {"lr": 0.01}, "dice-auto": {"lr": 0.2},
    "perturb": {"extra": {"k": 0.1}}, "self-aug": {"data": "digits-image", "model": "mlp", "extra": {"K": 2, "flip": False}},
    "dpgd-momentum": {"batch_size": 1347.0, "epochs": 3}, "inner-outer": {"extra": {"K0": 1}},
    "p-avg": {"extra": {"p": 3}}, "batch-clip": {"data": "fashion-mnist", "subset": 600, "model": "cnn-gn", "epochs": 1, "extra": {"p": 2, "public_size": 40, "draws": 1}},
    "adaptive": {}, "dice-perturb": {"extra": {"k": 0.1}}, "dice-self-aug": {"data": "digits-image", "model": "mlp", "extra": {"K": 2, "flip": False}},
    "disk": {"momentum": 0.5},
}
TIME_KEYS = {"wall_time_s", "wall_time_per_epoch_s", "epoch_time_s", "eval_time_s"}


def _tensors(obj, prefix=""):
    """(path, tensor) for every tensor in a nested dict/list, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            yield from _tensors(obj[k], f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}/{i}")


def _tensor_digest(obj) -> str:
    """SHA-256 over the sorted digests of every tensor: independent of key names and order, so a
    redesign may rename state keys but not change a single stored number."""
    parts = sorted(hashlib.sha256(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                                  + str(t.dtype).encode()).hexdigest() for _, t in _tensors(obj))
    return hashlib.sha256("".join(parts).encode()).hexdigest()


def _summary(obj, floats: bool) -> list[float] | str:
    """Floating tensors: [sum, sum of squares, sum of |x|] in float64 (compared with a tolerance);
    the others (RNG states, counters, indices): an exact digest."""
    ts = [t.detach().cpu() for _, t in _tensors(obj) if t.is_floating_point() == floats]
    if not floats:
        return _tensor_digest(ts)
    flat = torch.cat([t.double().reshape(-1) for t in ts]) if ts else torch.zeros(1, dtype=torch.float64)
    return [float(flat.sum()), float(flat.square().sum()), float(flat.abs().sum())]


def fingerprint() -> dict:
    """What the float results depend on besides the code."""
    return {"torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(),
            "machine": platform.machine(), "cpu_model": _cpu_model()}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        return platform.processor()


def _exact(v):
    """JSON numbers as exact strings (float.hex), recursively; drops timings."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, float):
        return v.hex() if math.isfinite(v) else repr(v)
    if isinstance(v, int):
        return v
    if isinstance(v, dict):
        return {k: _exact(x) for k, x in v.items() if k not in TIME_KEYS}
    if isinstance(v, list):
        return [_exact(x) for x in v]
    return repr(v)


def numbers(algo: str) -> dict:
    from clipbias.run.training import RESULTS, TrainConfig, load_checkpoint, train
    case = dict(CASES.get(algo, {}))
    cfg = TrainConfig(data=case.pop("data", "digits"), model=case.pop("model", "mlp"), algo=algo, epochs=case.pop("epochs", 2),
                      batch_size=case.pop("batch_size", 128.0), lr=case.pop("lr", 0.5), clip=1.0,
                      noise_multiplier=1.0 if _private(algo) else None, seed=3, reproducible_noise=True,
                      max_physical_batch=50, extra=case.pop("extra", {}), **case)
    with tempfile.TemporaryDirectory() as d:
        train(dataclasses.replace(cfg, out=d), progress=False, plot=False)
        with open(f"{d}/{RESULTS}") as f:
            res = json.load(f)
        ck = load_checkpoint(d)
    res.pop("config", None)
    res.pop("dataset", None)
    res.pop("world_size", None)  # recorded since issue 15 (1 here); not a number of the run's math
    return {"results": _exact(res), "model": _tensor_digest(ck["model"]),
            "engine": _tensor_digest(ck["engine"]), "model_summary": _summary(ck["model"], True),
            "engine_floats": _summary(ck["engine"], True), "engine_exact": _summary(ck["engine"], False)}


def _private(algo: str) -> bool:
    from clipbias.algorithms import get
    return get(algo).private


GOLDEN_PATH = pathlib.Path(__file__).parent / "data" / "behaviour.json"


def add(algos: list[str]) -> None:
    """Run ``algos`` and write their cases into ``GOLDEN_PATH`` (the others kept as they are), each with
    this machine's fingerprint where it is not the file's."""
    with open(GOLDEN_PATH) as f:
        golden = json.load(f)
    for a in algos:
        case = numbers(a)
        if fingerprint() != golden["fingerprint"]:
            case["fingerprint"] = fingerprint()
        golden["cases"][a] = case
    with open(GOLDEN_PATH, "w") as f:
        json.dump(golden, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1:2] == ["--add"]:
        add(sys.argv[2:])
        sys.exit()
    from clipbias.algorithms import ALGORITHMS
    algos = sys.argv[1:] or list(ALGORITHMS)
    json.dump({"fingerprint": fingerprint(), "cases": {a: numbers(a) for a in algos}}, sys.stdout, indent=1,
              sort_keys=True)
    print()
