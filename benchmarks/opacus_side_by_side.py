"""clipbias's Opacus interface against Opacus itself, on the same Opacus-style script.

Two measurements (docs/results.md, "Side by side with Opacus"):

* ``--part accuracy``: an Opacus training script (the CNN of Opacus's MNIST example on Fashion-MNIST, Adam +
  StepLR, a DataLoader,
  ``make_private_with_epsilon`` at epsilon 3) run with ``from opacus import PrivacyEngine`` and with
  ``from clipbias import PrivacyEngine``: test accuracy, the certified epsilon, seconds per epoch.
* ``--part speed``: seconds per step and peak memory (max RSS of a fresh process per arm) of that CNN
  (B = 256), a ResNet-18
  (torchvision's layout, BatchNorm replaced by GroupNorm with each library's fixer) and a small BERT
  (random weights) for a non-private step, clipbias (``grad_path`` auto and fast), Opacus hooks and Opacus
  ghost clipping. Poisson batches vary in size: the median over the steps is reported.

Opacus is not a dependency: put it on the path, e.g.
``pip install --no-deps --target /tmp/opacus_site opacus==1.6.0 opt-einsum`` and
``PYTHONPATH=/tmp/opacus_site python benchmarks/opacus_side_by_side.py --part speed``.
Takes ~5 minutes (speed) and ~6 minutes (accuracy, 3 seeds x 2 libraries x 3 epochs) on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from speed import cpu_description  # benchmarks/speed.py: name, vector extensions, cores


# ---------------------------------------------------------------- the Opacus-style script
def script(lib: str, seed: int, epochs: int, batch_size: int) -> dict:
    from clipbias.data import load_dataset
    if lib == "opacus":
        from opacus import PrivacyEngine
    else:
        from clipbias import PrivacyEngine
    torch.manual_seed(seed)
    ds = load_dataset("fashion-mnist")
    model = SampleConvNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    criterion = nn.CrossEntropyLoss()
    train_loader = DataLoader(TensorDataset(ds.x_train, ds.y_train), batch_size=batch_size)
    privacy_engine = PrivacyEngine()
    model, optimizer, train_loader = privacy_engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=train_loader, target_epsilon=3.0, target_delta=1e-5,
        epochs=epochs, max_grad_norm=1.0)
    times = []
    for _ in range(epochs):
        model.train()
        t = time.perf_counter()
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
        times.append(time.perf_counter() - t)
        scheduler.step()
    model.eval()
    with torch.no_grad():
        acc = sum((model(ds.x_test[i:i + 2000]).argmax(1) == ds.y_test[i:i + 2000]).sum().item()
                  for i in range(0, len(ds.y_test), 2000)) / len(ds.y_test)
    return {"lib": lib, "seed": seed, "test_accuracy": acc, "epsilon": privacy_engine.get_epsilon(1e-5),
            "s_per_epoch": times}


class SampleConvNet(nn.Module):
    """The convolutional network of Opacus's MNIST example (Tramer & Boneh's layout, tanh as theirs)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 16, 8, 2, padding=3), nn.Conv2d(16, 32, 4, 2)
        self.fc1, self.fc2 = nn.Linear(32 * 4 * 4, 32), nn.Linear(32, 10)

    def forward(self, x):
        x = nn.functional.max_pool2d(torch.tanh(self.conv1(x)), 2, 1)
        x = nn.functional.max_pool2d(torch.tanh(self.conv2(x)), 2, 1)
        return self.fc2(torch.tanh(self.fc1(x.flatten(1))))


# ---------------------------------------------------------------- speed and memory, one arm per process
class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    """torchvision's resnet18 layout (BasicBlock x [2, 2, 2, 2], 64-512 channels), 10 classes."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        blocks, cin = [], 64
        for cout, stride in ((64, 1), (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2), (512, 1)):
            blocks.append(BasicBlock(cin, cout, stride))
            cin = cout
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        return self.fc(self.layers(x).mean((2, 3)))


def _bert():
    from transformers import BertConfig, BertForSequenceClassification
    cfg = BertConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                     intermediate_size=1024, max_position_embeddings=128, num_labels=2, attn_implementation="eager",
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg)


class _Logits(nn.Module):
    def forward(self, out, y):
        return nn.functional.cross_entropy(out.logits, y)


def arm(model_name: str, which: str, batch_size: int, steps: int) -> dict:
    torch.manual_seed(0)
    n = batch_size * 8
    if model_name == "cnn":
        model = SampleConvNet()
        data = TensorDataset(torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,)))
        call = (lambda m, x: m(x))
        crit = nn.CrossEntropyLoss()
    elif model_name == "resnet18":
        model = ResNet18()
        data = TensorDataset(torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,)))
        call = (lambda m, x: m(x))
        crit = nn.CrossEntropyLoss()
    else:
        model = _bert()
        T = 64
        ids = torch.randint(0, 1000, (n, T))
        data = [({"input_ids": ids[i], "position_ids": torch.arange(T), "token_type_ids": torch.zeros(T, dtype=torch.long)},
                 torch.randint(0, 2, ()).long()) for i in range(n)]
        call = (lambda m, x: m(**x))
        crit = _Logits()
    if model_name == "resnet18":
        if which.startswith("opacus"):
            from opacus.validators import ModuleValidator
            model = ModuleValidator.fix(model)
            for m in model.modules():  # Opacus's hooks refuse an in-place ReLU on a hooked output
                if isinstance(m, nn.ReLU):
                    m.inplace = False
        else:
            import clipbias
            model = clipbias.fix(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(data, batch_size=batch_size)
    if which.startswith("clipbias"):
        from clipbias import PrivacyEngine
        model, optimizer, loader = PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                                noise_multiplier=1.0, max_grad_norm=1.0,
                                                                criterion=crit, grad_path=which[9:] or "auto")
    elif which.startswith("opacus"):
        from opacus import PrivacyEngine
        mode = "ghost" if which == "opacus-ghost" else "hooks"
        got = PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
                                           max_grad_norm=1.0, criterion=crit, grad_sample_mode=mode)
        model, optimizer, crit, loader = got if mode == "ghost" else (got[0], got[1], crit, got[2])
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    it = iter(loader)
    while len(times) < steps + 2:
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            continue
        if len(y) == 0:
            continue
        t = time.perf_counter()
        optimizer.zero_grad()
        loss = crit(call(model, x), y)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - t)
    times = sorted(times[2:])
    return {"model": model_name, "arm": which, "batch_size": batch_size, "s_per_step_median": times[len(times) // 2],
            "s_per_step_min": times[0], "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_after_build_mb": base_rss / 1024}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["accuracy", "speed"], required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--arm", nargs=4, metavar=("MODEL", "WHICH", "B", "STEPS"), help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.arm:
        print(json.dumps(arm(a.arm[0], a.arm[1], int(a.arm[2]), int(a.arm[3]))))
        return
    rows = []
    if a.part == "accuracy":
        for seed in a.seeds:
            for lib in ("opacus", "clipbias"):
                rows.append(script(lib, seed, a.epochs, 256))
                print(json.dumps(rows[-1]), flush=True)
    else:
        for model_name, bs in (("cnn", 256), ("resnet18", 32), ("bert", 16)):
            for which in ("nonprivate", "clipbias", "clipbias-fast", "opacus-hooks", "opacus-ghost"):
                out = subprocess.run([sys.executable, __file__, "--part", "speed", "--threads", str(a.threads), "--arm",
                                      model_name, which, str(bs), str(a.steps)], capture_output=True, text=True)
                if out.returncode:
                    rows.append({"model": model_name, "arm": which, "error": out.stderr.strip().splitlines()[-1]})
                else:
                    rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(json.dumps(rows[-1]), flush=True)
    result = {"cpu": cpu_description(), "threads": a.threads, "torch": torch.__version__, "part": a.part, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
