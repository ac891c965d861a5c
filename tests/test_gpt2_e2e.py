"""The Hugging Face GPT-2 E2E example (examples/gpt2_e2e.py) in --tiny mode, local weights with a
frozen LoRA base, and the per-example properties its privacy rests on."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from clipbias.engine.core import SEEDED_CAVEAT
from clipbias.config import AlgoConfig  # noqa: E402
from clipbias.engine.core import DPEngine  # noqa: E402
from clipbias.grads.rows import FuncGradients  # noqa: E402
from clipbias.sampling.loader import PoissonLoader  # noqa: E402
from clipbias.data.text import E2EDataset, LMCollate, read_e2e, sequence_loss  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpt2_e2e", ROOT / "examples" / "gpt2_e2e.py")
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)

FAST = ["--epochs", "1", "--batch-size", "8", "--max-length", "200", "--reproducible-noise", "--json"]


def run_json(capsys, argv):
    assert example.main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_tiny_dice_full_fine_tuning_reports_the_sound_epsilon(capsys):
    """--tiny: a random 2-layer GPT-2, every weight trained with DiceSGD; the epsilon is the sound
    error-feedback bound of these settings (an engine built on its own gives the same), certified,
    and the perplexity is exp(loss per token). (A fixed noise multiplier: calibrating to --epsilon
    takes 15-30 s of PLD bisection at these few steps.)"""
    assert example.main(["--tiny", "--algo", "dice", "--noise-multiplier", "2"] + FAST) == 0
    captured = capsys.readouterr()
    res = json.loads(captured.out)
    # progress with --json goes to stderr: the header, a step bar per epoch, a line per epoch
    assert "steps=6" in captured.err and "epoch 1/1: train loss/sequence" in captured.err
    assert res["trainable"] == res["parameters"] > 100_000 and res["train_sequences"] == 48
    ref = DPEngine(torch.nn.Linear(2, 2), "dice", n=48, batch_size=8, steps=6, noise_multiplier=2.0, delta=1 / 480)
    assert res["epsilon"] == pytest.approx(ref.privacy(6).epsilon, rel=1e-9) and 0.5 < res["epsilon"] < 0.7
    assert "sound" in res["basis"]
    assert res["certified"] is False and res["caveats"] == [SEEDED_CAVEAT]  # --reproducible-noise: a seeded key
    h = res["history"][-1]
    assert math.isclose(h["valid_perplexity"], math.exp(h["valid_loss_per_token"]), rel_tol=1e-9)
    assert res["steps"] == 6 and res["delta"] == pytest.approx(1 / 480)


def save_tiny(tmp_path: Path) -> Path:
    args = example.parse(["--tiny", "--max-length", "200"])
    model, tok = example.build(args)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    return tmp_path


def test_model_dir_with_lora_trains_the_adapters_only(tmp_path, capsys):
    """Local weights (save_pretrained layout) with --lora: the rows have the adapters' dimension,
    the frozen base is unchanged bit for bit, the adapters moved."""
    d = save_tiny(tmp_path)
    args = example.parse(["--model-dir", str(d), "--lora", "2", "--max-length", "200"])
    model, tok = example.build(args)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora) and len(base) > len(lora)
    data = E2EDataset(read_e2e(example.SAMPLE)[:40], tok, 200)
    eng = DPEngine(model, "dpsgd", n=40, batch_size=8, steps=3, noise_multiplier=1.0, loss_fn=sequence_loss,
                   config=AlgoConfig(lr=0.05, clip=1.0, optimizer="adam"), max_physical_batch=4, noise_seed=0)
    assert eng.rows.layout.dim == sum(p.numel() for p in lora.values())
    eng.train_epoch(PoissonLoader(eng, data, collate_fn=LMCollate(tok.pad_token_id)))
    now = dict(model.named_parameters())
    assert all(torch.equal(now[n], p) for n, p in base.items())
    assert any(not torch.equal(now[n], p) for n, p in lora.items())
    res = run_json(capsys, ["--model-dir", str(d), "--lora", "2", "--algo", "dpsgd", "--noise-multiplier", "1",
                            "--workers", "1"] + FAST)
    assert res["trainable"] == eng.rows.layout.dim and res["caveats"] == [SEEDED_CAVEAT]


def no_dropout_lora(seed=0):
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=257, n_positions=200, n_embd=32, n_layer=2, n_head=2, bos_token_id=256,
                     eos_token_id=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    m = GPT2LMHeadModel._from_config(cfg, attn_implementation="eager")
    return get_peft_model(m, LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["c_attn"],
                                        fan_in_fan_out=True))


def test_lora_fast_path_equals_rows_path():
    """With a frozen (tied) base the LoRA adapters are plain Linear layers: the book-keeping fast path
    applies and gives the rows path's update."""
    from clipbias.data.text import byte_tokenizer
    tok = byte_tokenizer()
    data = E2EDataset(read_e2e(example.SAMPLE)[:24], tok, 200)
    out = {}
    for path in ("rows", "fast"):
        m = no_dropout_lora()
        eng = DPEngine(m, "dice", n=24, batch_size=8, steps=2, noise_multiplier=1.0, loss_fn=sequence_loss,
                       config=AlgoConfig(lr=0.5, clip=0.1), noise_seed=3, grad_path=path)
        assert eng.fast is not None if path == "fast" else eng.fast is None
        eng.train_epoch(data, collate_fn=LMCollate(256))
        out[path] = torch.cat([p.detach().flatten() for p in m.parameters() if p.requires_grad])
    assert torch.allclose(out["fast"], out["rows"], rtol=1e-4, atol=1e-6)


def test_auto_takes_the_rows_path_for_lora_adapters():
    """LoRA's rows are small (the adapters' dimension) and GPT-2 is not per-example by construction: `auto`
    takes the rows path, the faster of the two for LoRA GPT-2 on the CPU (docs/models.md)."""
    eng = DPEngine(no_dropout_lora(), "dpsgd", n=24, batch_size=8, steps=2, noise_multiplier=1.0,
                   loss_fn=sequence_loss, grad_path="auto")
    assert eng.fast is None and eng.grad_path_note.startswith("rows")


def test_a_padded_example_has_the_gradient_it_has_alone():
    """Right padding with the attention mask: a short example's per-example gradient in a batch padded
    to a longer example's length equals its gradient alone (no dependence on the other example)."""
    from clipbias.data.text import byte_tokenizer
    tok = byte_tokenizer()
    pairs = read_e2e(example.SAMPLE)
    short, long = sorted(pairs[:10], key=lambda p: len(p[0]) + len(p[1]))[::9]
    data = E2EDataset([short, long], tok, 200)
    collate = LMCollate(256)
    fg = FuncGradients(no_dropout_lora(1), sequence_loss)
    both = collate([data[0], data[1]])
    assert both["input_ids"].shape[1] > len(data[0]["input_ids"])  # the short one is padded
    y = both.pop("labels")
    g_both, _ = fg(both, y)
    alone = collate([data[0]])
    ya = alone.pop("labels")
    g_alone, _ = fg(alone, ya)
    assert torch.allclose(g_both[0], g_alone[0], rtol=1e-4, atol=1e-7)


def test_fixed_length_padding_does_not_depend_on_the_batch():
    """--pad-to max-length: every batch has the same length whatever its longest example, so no
    model can see the other examples through the padding; the loss is that of the shorter padding."""
    from clipbias.data.text import byte_tokenizer
    tok = byte_tokenizer()
    data = E2EDataset(read_e2e(example.SAMPLE)[:3], tok, 200)
    fixed = LMCollate(256, 200)
    one, three = fixed([data[0]]), fixed([data[0], data[1], data[2]])
    assert one["input_ids"].shape == (1, 200) and three["input_ids"].shape == (3, 200)
    assert all(torch.equal(one[k][0], three[k][0]) for k in one)
    m = no_dropout_lora()
    lab = one.pop("labels")
    short = LMCollate(256)([data[0]])
    lab_s = short.pop("labels")
    assert torch.allclose(sequence_loss(m(**one), lab), sequence_loss(m(**short), lab_s), rtol=1e-5)
    with pytest.raises(Exception, match="more than the padding length"):
        LMCollate(256, 10)([data[0]])


def test_bad_model_dir_is_refused_by_name(tmp_path, capsys):
    assert example.main(["--model-dir", str(tmp_path), "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and str(tmp_path) in err
    assert example.main(["--tiny", "--train", str(tmp_path / "missing.csv")]) == 2
    assert "missing.csv" in capsys.readouterr().err
