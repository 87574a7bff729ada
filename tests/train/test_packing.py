"""Packed rows (packing.py) train exactly what their samples train apart.

A packed row holds several samples that must not see each other: attention inside each document (every
attention path: eager, the flash kernels' per-document calls, flex's mask), rotary positions restarting
at each, no loss where a TTT step reads past a document's end, and target states computed per sample.
These tests hold the packed loss and every gradient to the same samples as a padded batch, for both
draft architectures and both kinds of target, and the packer to keeping every sample exactly once.
"""

from __future__ import annotations

import copy
import random
import warnings
from types import SimpleNamespace

import pytest
import torch

from regen_service.train import packing
from regen_service.train.fixtures import make_tiny_target
from regen_service.train.packing import Documents, pack, packed_states
from regen_service.train.target import HFTarget
from regen_service.train.ttt import ttt_loss
from tests.train.test_fast import N_DRAFT as N
from tests.train.test_fast import N_VOCAB as V
from tests.train.test_grads import _draft, _rel

LENGTHS = [13, 7, 22, 5, 9, 16]  # six samples; rows of 32 hold them in three rows


def _samples(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        out.append(
            dict(
                ids=torch.randint(0, V, (n,), generator=g),
                mask=(torch.rand(n, generator=g) > 0.25).long(),
                aux=torch.randn(n, 96, generator=g),
                tgt=torch.randint(0, V, (n,), generator=g),
                probs=torch.softmax(torch.randn(n, N, generator=g) * 2, -1),
            )
        )
    return out


def _padded(samples):
    t = max(s["ids"].numel() for s in samples)
    out = {}
    for key in ("ids", "mask", "aux", "tgt", "probs"):
        x = torch.zeros(len(samples), t, *samples[0][key].shape[1:], dtype=samples[0][key].dtype)
        for i, s in enumerate(samples):
            x[i, : s[key].shape[0]] = s[key]
        out[key] = x
    return out


def _packed(samples, rows: list[list[int]], row_len: int):
    b = len(rows)
    out = {}
    for key in ("ids", "mask", "aux", "tgt", "probs"):
        x = torch.zeros(b, row_len, *samples[0][key].shape[1:], dtype=samples[0][key].dtype)
        for r, row in enumerate(rows):
            s0 = 0
            for i in row:
                n = samples[i][key].shape[0]
                x[r, s0 : s0 + n] = samples[i][key]
                s0 += n
        out[key] = x
    docs = Documents(tuple(tuple(LENGTHS[i] for i in row) for row in rows), row_len)
    return out, docs


def _loss(draft, x, soft: bool, docs=None):
    kw = {"target_probs": x["probs"]} if soft else {}
    return ttt_loss(draft, x["aux"], x["ids"], x["tgt"], x["mask"], 4, docs=docs, **kw)


@pytest.mark.parametrize("impl", ["eager", "flash"])  # flash on the CPU: flash_ttt's reference, per document
@pytest.mark.parametrize("soft", [True, False], ids=["soft", "hard"])
@pytest.mark.parametrize("arch", ["llama", "mla"])
def test_packed_rows_train_what_the_padded_batch_trains(arch, soft, impl):
    samples = _samples()
    ref = _draft(arch)
    new = copy.deepcopy(ref)
    new.set_attention(impl)
    l0, m0 = _loss(ref, _padded(samples), soft)
    l0.backward()
    # rows of 32 tokens (29, 27 and 16 of them samples): the padding after each is a segment of its own
    x, docs = _packed(samples, [[2, 1], [0, 3, 4], [5]], 32)
    l1, m1 = _loss(new, x, soft, docs)
    l1.backward()
    assert _rel(l1.detach(), l0.detach()) < 1e-5
    for i in range(4):  # the same positions count at every step: none reads across a document's end
        assert int(m1[f"tokens_{i}"]) == int(m0[f"tokens_{i}"]) > 0
        assert abs(float(m1[f"acc_{i}"]) - float(m0[f"acc_{i}"])) < 1e-6
    for (name, p0), (_, p1) in zip(ref.named_parameters(), new.named_parameters(), strict=True):
        if p0.grad is not None:
            assert _rel(p1.grad, p0.grad) < 1e-4, name


def test_packed_rows_without_the_document_mask_differ():
    """The equality above is not vacuous: the same row read as one sequence trains something else."""
    samples = _samples()
    draft = _draft("llama")
    l0, _ = _loss(draft, _padded(samples), True)
    x, _ = _packed(samples, [[2, 1], [0, 3, 4], [5]], 32)
    l1, _ = _loss(draft, x, True)
    assert _rel(l1.detach(), l0.detach()) > 1e-3


def test_flex_forward_keeps_to_the_documents_on_cpu():
    """flex_attention has no CPU backward: its packed forward (the documents in the mask_mod) against eager's."""
    samples = _samples()
    ref, new = _draft("llama"), _draft("llama")
    new.set_attention("flex")
    x, docs = _packed(samples, [[2, 1], [0, 3, 4], [5]], 32)
    with torch.no_grad(), warnings.catch_warnings():  # uncompiled flex warns that it is unfused
        warnings.simplefilter("ignore", UserWarning)
        a, _ = _loss(ref, x, True, docs)
        b, _ = _loss(new, x, True, docs)
    assert abs(a.item() - b.item()) <= 1e-5 * abs(a.item())


def test_documents_segments_ids_and_positions():
    d = Documents(((3, 2), (5,), (1, 1, 1)), 6)
    assert d.segments == ((0, 0, 3), (0, 3, 5), (0, 5, 6), (1, 0, 5), (1, 5, 6), (2, 0, 1), (2, 1, 2), (2, 2, 3),
                          (2, 3, 6))  # fmt: skip
    assert d.doc_ids().tolist() == [[1, 1, 1, 2, 2, 3], [1, 1, 1, 1, 1, 2], [1, 2, 3, 4, 4, 4]]
    assert d.positions().tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 0], [0, 0, 0, 0, 1, 2]]
    assert d.num_docs == 6
    with pytest.raises(ValueError, match="do not fit a row of 6"):
        Documents(((4, 3),), 6)


def _ex(n: int, vl=None, ids=None):
    ids = torch.arange(n) if ids is None else ids
    return SimpleNamespace(ids=ids, mask=torch.ones_like(ids), vl=vl)


def test_pack_keeps_every_sample_once_in_order_and_fills_rows():
    rnd = random.Random(0)
    lengths = [min(2048, max(20, int(rnd.lognormvariate(5.5, 1.0)))) for _ in range(3000)]
    exs = [_ex(n) for n in lengths]
    exs[17] = _ex(300, vl="an image")
    rows = pack(exs, 2048)
    seen = [id(e) for row in rows for e in row]
    assert sorted(seen) == sorted(id(e) for e in exs)  # every sample exactly once
    assert all(sum(e.ids.numel() for e in row) <= 2048 for row in rows)
    assert [row for row in rows if any(e is exs[17] for e in row)] == [[exs[17]]]  # images: a row alone
    for row in rows:  # inside a row, samples keep the order they were given in
        idx = [seen.index(id(e)) for e in row]
        assert idx == sorted(idx)
    fill = sum(lengths) / (len(rows) * 2048)
    assert fill > 0.95, fill
    again = pack(exs, 2048)  # deterministic: every rank packs the same rows
    assert [[id(e) for e in row] for row in again] == [[id(e) for e in row] for row in rows]
    with pytest.raises(ValueError, match="longer than the packed row"):
        pack([_ex(40)], 32)


def test_global_batch_docs_counts_every_ranks_rows():
    rows = [[1, 2], [3], [4, 5, 6], [7], [8, 9]]
    # two ranks, batch 2: rank 0 has rows 0, 2, 4; rank 1 rows 1, 3
    assert packing.global_batch_docs(rows, 2, 2, 0) == 2 + 3 + 1 + 1
    assert packing.global_batch_docs(rows, 2, 2, 1) == 2


def test_packed_states_are_each_samples_own(tmp_path):
    """A real (tiny, random) HF target: the packed row's states are each sample's states computed alone,
    never a sequence holding two samples."""
    target = HFTarget(str(make_tiny_target(tmp_path / "t", layers=4, hidden=32, heads=4, kv_heads=2)))
    g = torch.Generator().manual_seed(0)
    exs = [_ex(n, ids=torch.randint(0, target.vocab_size, (n,), generator=g)) for n in (9, 4, 12, 6)]
    rows = pack(exs, 16)
    assert [[e.ids.numel() for e in row] for row in rows] == [[9, 4], [12], [6]]
    draft_ids = torch.arange(3, target.vocab_size, 5)
    batch, aux, pred, logits, docs = packed_states(target, rows, draft_ids, 16)
    assert batch["input_ids"].shape == aux.shape[:2] == logits.shape[:2] == (3, 16)
    assert docs.lengths == ((9, 4), (12,), (6,))
    for r, row in enumerate(rows):
        s = 0
        for ex in row:
            e = s + ex.ids.numel()
            a, p, lg = target.states(ex.ids[None], None, draft_ids)
            assert torch.equal(batch["input_ids"][r, s:e], ex.ids)
            assert torch.allclose(aux[r, s:e], a[0], atol=1e-5)
            assert torch.equal(pred[r, s:e], p[0])
            assert torch.allclose(logits[r, s:e], lg[0], atol=1e-5)
            s = e
        # the row's padding: zeros, out of the loss and of the token count
        assert int(batch["attention_mask"][r, s:].sum()) == 0 and float(aux[r, s:].abs().sum()) == 0
        assert int(batch["attention_mask"][r, :s].sum()) == s


def test_auto_attention_skips_cudnn_for_packed_rows(monkeypatch, caplog):
    """Where cuDNN and FlashAttention-2 both run (a GPU's answer, played here), packed rows take
    FlashAttention-2: cuDNN would build a graph per document length. One sample a row keeps cuDNN."""
    from regen_service.train import flash_ttt
    from regen_service.train.trainer import choose_attention

    monkeypatch.setattr(flash_ttt, "supported", lambda dtype, hd, dev, backend="flash": backend != "fa4")
    cuda = torch.device("cuda")
    assert choose_attention("auto", torch.bfloat16, 128, cuda) == "cudnn"
    assert choose_attention("auto", torch.bfloat16, 128, cuda, packed=True) == "flash"
    with caplog.at_level("WARNING"):
        assert choose_attention("cudnn", torch.bfloat16, 128, cuda, packed=True) == "cudnn"
    assert "builds a graph for each new document length" in caplog.text
