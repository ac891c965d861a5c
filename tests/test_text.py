"""Tests for clipbias.data.text: E2E CSV reading, the byte-level tokenizer, LM examples, collation and
the per-sequence loss (against a loop over tokens, and under torch.func.vmap)."""

from __future__ import annotations

import ast
import importlib.util
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from clipbias.data.catalog import DataFormatError, DataNotFoundError
from clipbias.data.text import (IGNORE, E2EDataset, LMCollate, byte_tokenizer, lm_collate, prompt, read_e2e,
                           sequence_loss, token_count)

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "examples" / "data" / "e2e_sample.csv"
MR = "name[The Eagle], eatType[coffee shop], food[French], priceRange[moderate], near[Burger King]"
REF = "The Eagle is a coffee shop near Burger King serving French food at moderate prices."


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def tok():
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    return byte_tokenizer()


def test_importing_the_module_needs_neither_transformers_nor_tokenizers():
    tree = ast.parse((ROOT / "clipbias" / "data" / "text.py").read_text())
    top = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    top |= {n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
    assert not top & {"transformers", "tokenizers"}


# ---- read_e2e -------------------------------------------------------------------------------------

def test_read_e2e_reads_pairs_and_ignores_other_columns(tmp_path):
    p = write(tmp_path / "t.csv", f'id,mr,ref\n1,"{MR}",{REF}\n2,"name[Café Rouge], area[riverside]",'
                                  '"Café Rouge, by the riverside, costs £20-25."\n')
    assert read_e2e(p) == [(MR, REF), ("name[Café Rouge], area[riverside]",
                                       "Café Rouge, by the riverside, costs £20-25.")]
    assert read_e2e(str(p)) == read_e2e(p)


@pytest.mark.parametrize("text, what", [
    (None, "not found"),
    ("", "empty"),
    (f'mr,text\n"{MR}",{REF}\n', "ref"),
    (f'"{MR}",{REF}\n', "mr"),
    (f'mr,ref\n"{MR}",{REF}\n"{MR}", \n', "line 3: empty ref"),
    (f'mr,ref\n,{REF}\n', "line 2: empty mr"),
    ("mr,ref\n", "no rows"),
])
def test_read_e2e_bad_files_say_which_file_and_what(tmp_path, text, what):
    p = tmp_path / "bad.csv"
    if text is not None:
        write(p, text)
    with pytest.raises(DataNotFoundError if text is None else DataFormatError) as e:
        read_e2e(p)
    assert str(p) in str(e.value) and what in str(e.value)
    if text is None:
        assert "tuetschek/e2e-dataset" in str(e.value) and "trainset.csv" in str(e.value)


def test_the_shipped_sample_parses():
    pairs = read_e2e(SAMPLE)
    assert len(pairs) >= 50
    assert all(mr.startswith("name[") and 3 <= mr.count("[") <= 8 for mr, _ in pairs)
    assert len({mr for mr, _ in pairs}) > 40


def test_the_sample_generator_is_deterministic(tmp_path):
    spec = importlib.util.spec_from_file_location("make_e2e_sample", ROOT / "scripts" / "make_e2e_sample.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.main([str(tmp_path / "again.csv")])
    assert out.read_bytes() == SAMPLE.read_bytes()


# ---- tokenizer ------------------------------------------------------------------------------------

@pytest.mark.parametrize("s", ["name[The Eagle], food[French] || The Eagle serves French food.",
                               "Café Rouge costs £20-25, 日本料理 🙂", "  two  spaces\tand\na newline ", ""])
def test_byte_tokenizer_round_trips(tok, s):
    ids = tok.encode(s, add_special_tokens=False)
    assert len(ids) == len(s.encode("utf-8"))  # one token per byte: nothing learned
    assert tok.decode(ids) == s


def test_byte_tokenizer_is_fixed_and_data_independent(tok):
    from tokenizers.pre_tokenizers import ByteLevel
    assert len(tok) == 257 and tok.eos_token_id == tok.pad_token_id == tok.bos_token_id == 256
    vocab = tok.get_vocab()
    assert vocab == {**{s: i for i, s in enumerate(sorted(ByteLevel.alphabet()))}, "<|endoftext|>": 256}
    assert byte_tokenizer().get_vocab() == vocab  # nothing but code decides it


# ---- dataset and collation ------------------------------------------------------------------------

def test_e2e_dataset_masks_the_prompt_and_ends_with_eos(tok):
    ds = E2EDataset([(MR, REF), ("name[Zizzi], area[riverside]", "Zizzi is by the riverside.")], tok,
                    max_length=512)
    assert len(ds) == 2 and prompt(MR) == MR + " ||"
    item = ds[0]
    n_prompt = len(tok.encode(prompt(MR), add_special_tokens=False))
    ids, labels = item["input_ids"], item["labels"]
    assert ids.dtype == labels.dtype == torch.long and ids.shape == labels.shape
    assert ids.tolist() == tok.encode(MR + " || " + REF, add_special_tokens=False) + [tok.eos_token_id]
    assert (labels[:n_prompt] == IGNORE).all() and torch.equal(labels[n_prompt:], ids[n_prompt:])
    assert tok.decode(ids[n_prompt:-1]) == " " + REF and ids[-1] == tok.eos_token_id
    assert torch.equal(pickle.loads(pickle.dumps(ds))[1]["input_ids"], ds[1]["input_ids"])


def test_e2e_dataset_truncates(tok):
    n_prompt = len(tok.encode(prompt(MR), add_special_tokens=False))
    item = E2EDataset([(MR, REF)], tok, max_length=n_prompt + 5)[0]
    assert len(item["input_ids"]) == n_prompt + 5 and (item["labels"] != IGNORE).sum() == 5
    short = E2EDataset([(MR, REF)], tok, max_length=10)[0]  # prompt alone too long: no target left
    assert len(short["input_ids"]) == 10 and (short["labels"] == IGNORE).all()


def test_lm_collate_pads_on_the_right():
    items = [{"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([IGNORE, 6, 7])},
             {"input_ids": torch.tensor([8]), "labels": torch.tensor([8])}]
    b = lm_collate(items, pad_id=256)
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 256, 256]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b["labels"].tolist() == [[IGNORE, 6, 7], [8, IGNORE, IGNORE]]
    assert all(t.dtype == torch.long for t in b.values())
    collate = pickle.loads(pickle.dumps(LMCollate(256)))
    assert all(torch.equal(collate(items)[k], b[k]) for k in b)
    assert collate(items[1:])["input_ids"].shape == (1, 1)  # T is the batch's own longest


# ---- loss ---------------------------------------------------------------------------------------

def loss_by_loop(logits, labels):
    out = []
    for i in range(logits.shape[0]):
        total = torch.zeros(())
        for t in range(logits.shape[1] - 1):
            if labels[i, t + 1] != IGNORE:
                total = total + F.cross_entropy(logits[i, t][None], labels[i, t + 1][None])
        out.append(total)
    return torch.stack(out)


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 11, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 11, (3, 6), generator=g)
    labels[0, :2] = IGNORE            # a prompt
    labels[1, 4:] = IGNORE            # padding
    labels[2, 1:] = IGNORE            # no target token (position 0 is never predicted)
    return logits, labels


def test_sequence_loss_sums_token_losses_per_example(batch):
    logits, labels = batch
    loss = sequence_loss(logits, labels)
    assert loss.shape == (3,) and loss[2] == 0
    torch.testing.assert_close(loss, loss_by_loop(logits, labels))

    class Out:  # a Hugging Face ModelOutput carries .logits
        pass
    out = Out()
    out.logits = logits
    torch.testing.assert_close(sequence_loss(out, labels), loss)
    assert token_count(labels).tolist() == [4, 3, 0]


def test_sequence_loss_under_vmap(batch):
    logits, labels = batch
    def one(lg, lb):
        return sequence_loss(lg[None], lb[None])[0]
    torch.testing.assert_close(torch.func.vmap(one)(logits, labels), sequence_loss(logits, labels))

    # per-example gradients through a tiny LM, as a DP engine takes them
    emb = torch.randn(11, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ids = labels.clamp(min=0)
    per_ex = torch.func.vmap(torch.func.grad(lambda w, x, y: sequence_loss(w[x[None]], y[None]).sum()),
                             in_dims=(None, 0, 0))(emb, ids, labels)
    for i in range(3):
        w = emb.clone().requires_grad_()
        sequence_loss(w[ids[i:i + 1]], labels[i:i + 1]).sum().backward()
        torch.testing.assert_close(per_ex[i], w.grad)
