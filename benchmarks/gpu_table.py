"""One GPU, one command: step time and peak memory of non-private, clipbias, Opacus hooks and Opacus ghost clipping.

Issue 58, item 5. The models, data, losses and clipbias's engine are ``benchmarks/hf_side_by_side.py``'s (imported,
not copied): ``bert`` is ``BertForSequenceClassification(BertConfig(num_labels=2))`` (BERT-base, 110M) and ``gpt2``
``GPT2LMHeadModel(GPT2Config())`` (GPT-2 small, 124M, tied input/output embeddings), random weights, eager attention,
dropout 0.1, train mode, T = 128 tokens, fixed batches of exactly B examples (no Poisson sampling: every arm does
the same work). Arms:

* ``nonprivate``: one backward of the batch's mean loss, AdamW;
* ``clipbias``: ``hf_side_by_side.engine``: ``DPEngine(..., "dpsgd", grad_path="auto")``, AdamW, one physical batch
  of B (the path ``auto`` took is in the status); bfloat16 through ``DPEngine(autocast=torch.bfloat16)``;
* ``opacus-hooks``, ``opacus-ghost``: ``PrivacyEngine().make_private(..., grad_sample_mode="hooks"/"ghost",
  poisson_sampling=False)``, AdamW. Ghost clipping refuses GPT-2's tied embeddings: the row's status says so.

Non-private and Opacus run bfloat16 as ``torch.autocast(device, torch.bfloat16)`` around the forward and the loss
(the backward outside it). float32 rows run at torch's defaults (TF32 matrix products off; the header says).

Each row (model, B, precision, arm): a fresh copy of the model on the device, ``--warmup`` steps (default 3), then
``--steps`` timed steps (default 10), each ended by ``torch.cuda.synchronize``; ms/step is their median. Peak memory:
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus what was allocated before the model was
copied to the device (on the CPU, indicative only: the peak RSS, Linux's VmHWM reset before the row, minus the RSS
then; memory the row before freed and this one reuses does not show). Each
(model, arm) runs in a fresh process (its rows one after the other, everything freed between them), so one arm's
allocations, hooks or a crash cannot touch another's. Without Opacus (``import opacus`` fails) its arms are skipped
and the table says so.

``--max-seconds S``: the run stops cleanly before S seconds: no process is started, and no row begun, that would not
end in time (estimated from the row before it), a row's timed steps stop at the budget (the status says how many
ran), and a process still running at the end is killed; the table is written after every process.

Output: a markdown table (model, B, precision, arm, ms/step, x non-private, x Opacus ghost, peak GiB, status), the
device's name, the torch version and the exact command, printed and written to ``--out``; the rows as JSON to
``--json``. On one GPU (Opacus carried in a folder on ``PYTHONPATH``)::

    PYTHONPATH=.:/tmp/opacus_site python benchmarks/gpu_table.py --device cuda --max-seconds 480 \\
        --out benchmarks/results/gpu/gpu_table.md --json benchmarks/results/gpu/gpu_table.json

and its smoke test on the CPU (2 layers, width 64, vocabulary 1024, T = 16, B = 4 and 8)::

    PYTHONPATH=.:/tmp/opacus_site python benchmarks/gpu_table.py --device cpu --tiny --warmup 1 --steps 3
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
import warnings

import hf_side_by_side as hf  # benchmarks/: build, Loss, fixed_batches, engine (its globals B and T set the shape)
import torch
from autocast_cost import (  # benchmarks/: the CPU's peak RSS of a stretch of code
    _peak_gb,
    _reset_peak,
    _rss_gb,
)

ARMS = ("nonprivate", "clipbias", "opacus-hooks", "opacus-ghost")  # the table's order
RUN_ORDER = ("nonprivate", "clipbias", "opacus-ghost", "opacus-hooks")  # the slowest, largest arm last
PRECISIONS = ("fp32", "bf16")
# --tiny: hf_side_by_side.build's configs with these settings (2 layers, width 64, a small vocabulary)
TINY = {"gpt2": {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1024},
        "bert": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 256,
                 "vocab_size": 1024}}
START_S = 30  # no process is started with less of the budget left (imports, CUDA, the model's build)


@contextlib.contextmanager
def patched(owner, name: str, value):
    """``owner.name`` is ``value`` inside the block."""
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def template(name: str, tiny: bool):
    """``hf_side_by_side.build(name)`` (on the CPU), with the tiny settings in its config under ``--tiny``."""
    import transformers
    cfg = "GPT2Config" if name == "gpt2" else "BertConfig"
    with patched(transformers, cfg, functools.partial(getattr(transformers, cfg), **TINY[name])) if tiny \
            else contextlib.nullcontext():
        return hf.build(name)


def stepper(name: str, which: str, model, dtype, steps: int, dev: torch.device):
    """One step of the arm on ``model`` (already on the device)."""
    if which == "clipbias":
        from clipbias.engine import core
        with patched(core, "DPEngine", functools.partial(core.DPEngine, autocast=dtype)):
            eng = hf.engine(model, name, steps, "auto")
        return (lambda x, y, idx: eng.step(x, y, idx)), eng.grad_path_note.split(" ")[0]
    crit = hf.Loss(name == "gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if which.startswith("opacus"):
        model, opt, crit = hf.opacus_private(which, model, opt, crit, hf.B * steps, hf.B)

    def step(x, y, idx):
        opt.zero_grad()
        with torch.autocast(dev.type, dtype=dtype) if dtype is not None else contextlib.nullcontext():
            loss = crit(model(**x), y)
        loss.backward()
        opt.step()
    return step, None


def _mem_start(dev: torch.device) -> float:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated() / 2**30
    _reset_peak()
    return _rss_gb()


def _mem_peak(dev: torch.device) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else _peak_gb()


def _why(e: BaseException) -> str:
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return "out of memory"
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:140]}"


def row(name: str, which: str, b: int, precision: str, tmpl, make, dev: torch.device, warmup: int, steps: int,
        deadline: float) -> dict:
    """One row: a fresh copy of the model, ``warmup`` steps, ``steps`` timed ones (stopped at ``deadline``)."""
    hf.B = b
    dtype = torch.bfloat16 if precision == "bf16" else None
    out = {"model": name, "B": b, "T": hf.T, "precision": precision, "arm": which, "ms": None, "peak_gib": None,
           "parameters": sum(p.numel() for p in tmpl.parameters())}
    t0 = time.perf_counter()
    before = _mem_start(dev)
    batches = [({k: v.to(dev) for k, v in x.items()}, y.to(dev), idx)
               for x, y, idx in hf.fixed_batches(make, warmup + steps)]
    phase = "setup"
    try:
        model = copy.deepcopy(tmpl).to(dev)
        model.train()
        step, path = stepper(name, which, model, dtype, warmup + steps, dev)
        out["setup_s"] = time.perf_counter() - t0
        times = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # clipbias: indices its sampler did not draw (speed only)
            for s, (x, y, idx) in enumerate(batches):
                if time.time() > deadline:
                    break
                phase = f"step {s + 1}"
                t = time.perf_counter()
                step(x, y, idx)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                if s >= warmup:
                    times.append(time.perf_counter() - t)
        out["ms_all"] = [1e3 * t for t in times]
        if times:
            out["ms"] = statistics.median(out["ms_all"])
            out["peak_gib"] = _mem_peak(dev) - before
        out["status"] = ("ok" if len(times) == steps else f"cut by --max-seconds: {len(times)} of {steps} timed "
                         f"steps") + (f", {path} path" if path else "")
    except Exception as e:  # noqa: BLE001 - a refusal or failure is the row's status
        refused = phase == "setup" or isinstance(e, NotImplementedError)  # Opacus ghost: at the first backward
        out["status"] = f"{'refused' if refused else 'failed'} at {phase}: {_why(e)}"
    out["allocated_before_gib"], out["wall_s"] = before, time.perf_counter() - t0
    return out


def child(a) -> None:
    """A fresh process: every row of one (model, arm), one JSON line each."""
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    hf.T = 16 if a.tiny else 128
    torch.manual_seed(0)
    tmpl, make = template(a.child[0], a.tiny)
    last = None  # (B, wall seconds) of the row before
    for precision in a.precisions:
        for b in a.batch_sizes:
            est = last[1] * max(1.0, b / last[0]) if last else 0.0
            if time.time() + est > a.deadline:
                r = {"model": a.child[0], "B": b, "precision": precision, "arm": a.child[1], "ms": None,
                     "peak_gib": None, "status": f"skipped: --max-seconds (about {est:.0f} s needed)"}
            else:
                r = row(a.child[0], a.child[1], b, precision, tmpl, make, dev, a.warmup, a.steps, a.deadline)
                last = (b, r["wall_s"])
            r["device"] = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
            print(json.dumps(r), flush=True)


def table(rows: list[dict], models: list[str], a) -> str:
    key = {(r["model"], r["B"], r["precision"], r["arm"]): r for r in rows}
    lines = ["| model | B | precision | arm | ms/step | x non-private | x Opacus ghost | peak GiB | status |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m in models:
        for b in a.batch_sizes:
            for p in a.precisions:
                for arm in a.arms:
                    r = key.get((m, b, p, arm))
                    if r is None:
                        continue
                    ms = r.get("ms")
                    ratio = []
                    for base in ("nonprivate", "opacus-ghost"):
                        other = (key.get((m, b, p, base)) or {}).get("ms")
                        ratio.append(f"{ms / other:.2f}" if ms and other else "-")
                    peak = f"{r['peak_gib']:.2f}" if r.get("peak_gib") is not None else "-"
                    lines.append(f"| {m} | {b} | {p} | {arm} | {f'{ms:.1f}' if ms else '-'} | {ratio[0]} | "
                                 f"{ratio[1]} | {peak} | {r['status']} |")
    return "\n".join(lines)


def report(rows: list[dict], a, command: str, started: float, opacus: str | None) -> str:
    import transformers
    device = next((r["device"] for r in rows if r.get("device")), a.device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    return "\n".join([
        (f"device: {device} ({a.device}); torch {torch.__version__}; transformers {transformers.__version__}; "
         f"opacus {opacus or 'not importable: its arms skipped'}"),
        f"float32 matrix products: TF32 {'on' if tf32 else 'off (torch default)'}; bf16: autocast",
        (f"T = {16 if a.tiny else 128}{' (--tiny)' if a.tiny else ''}; {a.warmup} warm-up + {a.steps} timed steps "
         f"per row (median ms); one process per (model, arm); wall {time.time() - started:.0f} s"
         + (f" of --max-seconds {a.max_seconds:.0f}" if a.max_seconds else "")),
        f"command: {command}", "", table(rows, a.models, a), ""])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="2 layers, width 64, T = 16, B = 4 and 8 (a smoke test)")
    p.add_argument("--models", nargs="+", choices=["bert", "gpt2"], default=["bert", "gpt2"])
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--batch-sizes", nargs="+", type=int, default=None, help="default 8 32 64 (--tiny: 4 8)")
    p.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps per row")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of each process")
    p.add_argument("--max-seconds", type=float, default=None, help="stop cleanly before this many seconds")
    p.add_argument("--out", default=None, help="write the markdown report here")
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    p.add_argument("--child", nargs=2, metavar=("MODEL", "ARM"), help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    a = p.parse_args()
    a.batch_sizes = a.batch_sizes or ([4, 8] if a.tiny else [8, 32, 64])
    if a.child:
        child(a)
        return
    started = time.time()
    hard = started + a.max_seconds if a.max_seconds else float("inf")
    soft = hard - min(30.0, max(10.0, 0.05 * a.max_seconds)) if a.max_seconds else float("inf")  # rows end
    command = f"PYTHONPATH={os.environ.get('PYTHONPATH', '')} python {shlex.join(sys.argv)}"
    opacus = None
    if importlib.util.find_spec("opacus") is not None:
        from importlib.metadata import PackageNotFoundError, version
        try:
            opacus = version("opacus")
        except PackageNotFoundError:
            opacus = "(version unknown)"
    rows: list[dict] = []
    for m in a.models:
        for arm in [x for x in RUN_ORDER if x in a.arms]:
            cells = [{"model": m, "B": b, "precision": pr, "arm": arm, "ms": None, "peak_gib": None}
                     for pr in a.precisions for b in a.batch_sizes]
            if arm.startswith("opacus") and opacus is None:
                rows += [dict(c, status="skipped: opacus not importable (PYTHONPATH=...:/tmp/opacus_site)")
                         for c in cells]
                continue
            if hard - time.time() < START_S:
                rows += [dict(c, status="skipped: --max-seconds") for c in cells]
                continue
            args = [sys.executable, __file__, "--child", m, arm, "--device", a.device, "--warmup", str(a.warmup),
                    "--steps", str(a.steps), "--threads", str(a.threads), "--deadline", repr(soft),
                    "--batch-sizes", *map(str, a.batch_sizes), "--precisions", *a.precisions] + \
                (["--tiny"] if a.tiny else [])
            t = time.perf_counter()
            try:
                got = subprocess.run(args, capture_output=True, text=True, check=False,
                                     timeout=None if hard == float("inf") else max(1.0, hard - 3 - time.time()))
                stdout = got.stdout
                err = (got.stderr.strip().splitlines() or ["?"])[-1] if got.returncode else "no row printed"
            except subprocess.TimeoutExpired as e:
                stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                err = "killed at --max-seconds"
            done = [json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{")]
            ran = {(r["B"], r["precision"]) for r in done}
            rows += done + [dict(c, status=f"process ended: {err}"[:200]) for c in cells
                            if (c["B"], c["precision"]) not in ran]
            print(f"{m} {arm}: {len(done)} rows in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
            text = report(rows, a, command, started, opacus)
            if a.out:  # after every process, so an interrupted run keeps what it measured
                with open(a.out, "w") as f:
                    f.write(text)
            if a.json:
                with open(a.json, "w") as f:
                    json.dump({"command": command, "torch": torch.__version__, "opacus": opacus, "rows": rows}, f,
                              indent=1)
    print(report(rows, a, command, started, opacus))


if __name__ == "__main__":
    main()
