"""Issue 57, point 3: label dtypes and shapes end in a ``ConfigError`` in the caller's interface's words
(``loss_fn`` for the engine, ``criterion`` for the Opacus interface, Hugging Face's ``problem_type`` rule for
``DPTrainer``), or work where the conversion is exact (int32 class indices); the auto fall-back's warning
says its reason whole."""

from __future__ import annotations

import ast
import pathlib
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from clipbias import PrivacyEngine
from clipbias.config import AlgoConfig
from clipbias.engine import DPEngine
from clipbias.errors import ConfigError

N, D, K = 32, 4, 3


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, D, generator=g), torch.randint(0, K, (N,), generator=g)


def _engine(**kw) -> DPEngine:
    torch.manual_seed(0)
    model = nn.Linear(D, K)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (noise_seed: uncertified, said once)
        return DPEngine(model, "dpsgd", n=N, batch_size=8, steps=2, noise_multiplier=1.0,
                        config=AlgoConfig(lr=0.1, clip=1.0), noise_seed=5, **kw)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
@pytest.mark.parametrize("grad_path", ["rows", "fast"])
def test_integer_class_indices_of_any_dtype_step_as_torch_long(dtype, grad_path):
    """torch's cross-entropy refuses int32 targets; the engine takes them as the class indices they are: the
    same step, bit for bit, as with torch.long labels."""
    x, y = _data()
    ref, eng = _engine(grad_path=grad_path), _engine(grad_path=grad_path)
    idx = ref.sampler.sample()
    assert torch.equal(idx, eng.sampler.sample())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref.step(x[idx], y[idx], idx)
        eng.step(x[idx], y[idx].to(dtype), idx)
    assert all(torch.equal(p, q) for p, q in zip(ref.model.parameters(), eng.model.parameters()))


@pytest.mark.parametrize("labels, words", [(lambda y: y.float(), "got torch.float32"),
                                           (lambda y: y > 0, "got torch.bool; convert them with y.long() (False")])
def test_labels_that_are_not_integers_are_refused_naming_loss_fn(labels, words):
    x, y = _data()
    eng = _engine()
    idx = eng.sampler.sample()
    with pytest.raises(ConfigError, match="integer class indices") as e:
        eng.step(x[idx], labels(y)[idx], idx)
    assert words in str(e.value) and "pass your own loss_fn" in str(e.value) and eng.steps_taken == 0


def _opacus(y: torch.Tensor, criterion=None):
    x, _ = _data()
    torch.manual_seed(0)
    m = nn.Linear(D, K)
    model, opt, loader = PrivacyEngine().make_private(
        module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8), criterion=criterion)
    for xb, yb in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb.long()).backward()
        opt.step()
    return model


def test_int32_labels_train_through_the_opacus_interface():
    _, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no warning either: the loop's loss is criterion's)
        _opacus(y.int())


def test_the_opacus_interface_refuses_bool_and_float_labels_naming_criterion():
    """With ``criterion`` (cross-entropy) the step takes the loader's labels: bool and float ones are refused in
    the interface's words. Without it the loop's own loss is trained, with the labels as the loop casts them
    (``yb.long()``): nothing to refuse."""
    _, y = _data()
    for bad in (y > 0, y.float()):
        with pytest.raises(ConfigError, match="integer class indices") as e:
            _opacus(bad, criterion=nn.CrossEntropyLoss())
        assert "pass your own criterion" in str(e.value) and "loss_fn" not in str(e.value)
        _opacus(bad)


class _Branchy(nn.Module):
    """A forward that branches on tensor values: vmap cannot run it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, K)

    def forward(self, x):
        if bool((x != 0).all()):
            x = x * 1.0
        return self.lin(x)


def test_the_auto_fall_back_warning_says_its_reason_whole():
    x, y = _data()
    torch.manual_seed(0)
    eng = DPEngine(_Branchy(), "dpsgd", n=N, batch_size=8, steps=2, noise_multiplier=1.0,
                   config=AlgoConfig(lr=0.1, clip=1.0))
    idx = eng.sampler.sample()
    with pytest.warns(UserWarning, match="grad_path='auto'") as got:
        eng.step(x[idx], y[idx], idx)
    said = " ".join(str(w.message) for w in got)
    whole = "(data-dependent control flow or .item(), as in Hugging Face's attention-mask code)"
    assert whole in said and whole in eng.grad_path_fallback and "e.g)" not in said + eng.grad_path_fallback


def test_no_path_refusal_has_an_abbreviation_in_its_first_sentence():
    """The auto fall-back quotes a refusal's first sentence (up to the first '. '): an "e.g. " inside it would cut
    the reason short, as "(data-dependent control flow or .item(), e.g)" did."""
    root = pathlib.Path(__file__).resolve().parents[1] / "clipbias"
    found = []
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            is_refusal = isinstance(node, ast.Call) and getattr(node.func, "id", None) == "PathRefusal"
            is_reason = isinstance(node, ast.Assign) and any(getattr(t, "id", "") in ("why", "_MIXING")
                                                             for t in node.targets)
            if is_refusal or (is_reason and "grads" in path.parts):
                text = "".join(c.value for c in ast.walk(node) if isinstance(c, ast.Constant)
                               and isinstance(c.value, str))
                first = text.split(". ")[0]
                if first.endswith(("e.g", "i.e", "etc", "vs", "cf")):
                    found.append(f"{path.name}:{node.lineno}: {first[-60:]}")
    assert not found, found


# ---------------------------------------------------------------------- Hugging Face's problem_type rule
def _bert(**config):
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=17,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **config)
    return BertForSequenceClassification._from_config(cfg, attn_implementation="eager")


class _Items(torch.utils.data.Dataset):
    def __init__(self, labels: torch.Tensor) -> None:
        self.ids, self.labels = torch.randint(1, 100, (len(labels), 6), generator=torch.Generator().manual_seed(1)), labels

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _collate(items: list) -> dict:
    ids = torch.stack([it["input_ids"] for it in items])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids),
            "position_ids": torch.arange(ids.shape[1]).expand(len(ids), -1).clone(),
            "labels": torch.stack([it["labels"] for it in items])}


def _trainer(tmp_path, model, labels):
    from transformers import TrainingArguments

    from clipbias.integrations.transformers import DPArguments, DPTrainer
    # (8 planned steps: a Poisson batch of the 16 examples at q = 1/4 is empty with probability 1 %, and the labels
    # are checked at the first step that holds one; 8 empty batches in a row: 1e-16)
    args = TrainingArguments(str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=8, save_strategy="no",
                             report_to=[], use_cpu=True, disable_tqdm=True)
    return DPTrainer(model=model, args=args, train_dataset=_Items(labels), data_collator=_collate,
                     dp_args=DPArguments(noise_multiplier=1.0, max_grad_norm=1.0, grad_path="fast"))


def test_float_labels_with_two_classes_say_hugging_faces_rule_and_what_to_pass(tmp_path):
    """Float labels, num_labels == 2: Hugging Face's rule makes the problem multi-label (binary cross-entropy
    over one float per class), which labels of shape [batch] cannot be: a ConfigError, not torch's ValueError."""
    model = _bert(num_labels=2)
    with pytest.raises(ConfigError) as e:
        _trainer(tmp_path, model, torch.tensor([0.0, 1.0] * 8)).train()
    said = str(e.value)
    for words in ("config.problem_type is unset", "num_labels == 2", "torch.float32", "multi_label_classification",
                  "labels of shape [batch, 2]", "got labels of shape [batch]", "integer class ids (torch.long",
                  "set model.config.problem_type"):
        assert words in said, words
    assert type(e.value) is ConfigError and e.value.__cause__ is None  # (not torch's ValueError, wrapped)


def test_a_set_problem_type_decides_and_is_named():
    from clipbias.integrations.transformers import sequence_classification_loss
    model = _bert(num_labels=2, problem_type="single_label_classification")
    loss = sequence_classification_loss(2, config=model.config)
    logits = torch.randn(3, 2)
    with pytest.raises(ConfigError, match="the model's config.problem_type is 'single_label_classification', which "
                                          "takes integer class ids"):
        loss(logits, torch.tensor([0.0, 1.0, 1.0]))
    model.config.problem_type = "multi_label_classification"  # integer multi-hot labels: the rule set says BCE
    multi = torch.tensor([[0, 1], [1, 1], [0, 0]])
    want = nn.functional.binary_cross_entropy_with_logits(logits, multi.float(), reduction="none").mean(1)
    assert torch.allclose(loss(logits, multi), want)
    model.config.problem_type = "regression"
    target = torch.randn(3, 2)
    assert torch.allclose(loss(logits, target), ((logits - target) ** 2).mean(1))


@pytest.mark.parametrize("labels", [torch.tensor([0, 1, 1]), torch.tensor([0, 1, 1], dtype=torch.int32),
                                    torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, 1.0]])])
def test_the_per_example_loss_is_the_models_own_loss_per_example(labels):
    """Integer (int64 or int32) class ids and float multi-labels: each example's loss is the loss the model
    computes on that example alone, under Hugging Face's rule."""
    from clipbias.integrations.transformers import sequence_classification_loss
    model = _bert(num_labels=2).eval()
    ids = torch.randint(1, 100, (3, 5), generator=torch.Generator().manual_seed(2))
    loss = sequence_classification_loss(2, config=model.config)
    with torch.no_grad():
        mine = loss(model(input_ids=ids), labels)
        theirs = []
        for i in range(3):
            model.config.problem_type = None  # (the model writes the rule's choice into its config)
            theirs.append(model(input_ids=ids[i:i + 1], labels=labels[i:i + 1].long() if not labels.is_floating_point()
                                else labels[i:i + 1]).loss)
    assert torch.allclose(mine, torch.stack(theirs), atol=1e-6)
