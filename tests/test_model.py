"""model.py: the packed and unpadded forward against Hugging Face's own BertForPreTraining (exact, in fp32), its
input contract (sparse_targets, prepare), torch.compile's dynamic shapes, and the GPU peak table behind MFU."""
import itertools

import pytest
import torch
from conftest import make_stream

import model as M

# (the device's name, the autocast dtype (None: fp32), TF32 matmuls, its peak FLOP/s or None)
GPU_PEAKS = [
    ("NVIDIA L4", torch.bfloat16, False, 121e12), ("NVIDIA L40", torch.bfloat16, False, 181e12),
    ("NVIDIA L40S", torch.float16, False, 362e12), ("NVIDIA H100 PCIe", torch.bfloat16, False, 756e12),
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, False, 989e12), ("NVIDIA A10G", torch.bfloat16, False, 70e12),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, False, 312e12),
    ("NVIDIA A100-SXM4-80GB", None, True, 156e12),  # fp32 run, TF32 matmuls
    ("NVIDIA A100-SXM4-80GB", None, False, 19.5e12),  # fp32 run, full-precision matmuls
    ("Some Future GPU", torch.bfloat16, False, None),
    # whole words, the longest key first: an H200 NVL has its own figures, a V100 PCIe its own, and
    # an RTX A1000 is no A100, a T400 no T4
    ("NVIDIA H200 NVL", torch.bfloat16, False, 835e12), ("NVIDIA H200", torch.bfloat16, False, 989e12),
    ("NVIDIA GB200", torch.bfloat16, False, 2500e12), ("Tesla V100-PCIE-16GB", torch.float16, False, 112e12),
    ("Tesla V100-SXM2-32GB", torch.float16, False, 125e12), ("Tesla T4", torch.float16, False, 65e12),
    ("NVIDIA RTX A1000", torch.bfloat16, False, None), ("NVIDIA T400 4GB", torch.float16, False, None),
]


def test_gpu_peaks_pick_the_most_specific_name_and_the_math_used():
    """L40/L40S are not L4, H100 PCIe is not SXM, fp32 and TF32 have their own peaks, unknown is None."""
    for name, dtype, tf32, peak in GPU_PEAKS:
        assert M.gpu_peak(name, dtype, tf32) == peak, (name, dtype, tf32)


def pair_keys(batch):
    """(pair, position in the pair) of each masked position of a batch from sparse_targets (whose
    positions count the real tokens: real_pos says where they are in the rows)."""
    pos, cls_pos = batch["masked_pos"], batch["cls_pos"]
    if "real_pos" in batch:
        pos, cls_pos = batch["real_pos"][pos], batch["real_pos"][cls_pos]
    if "sequence_ids" in batch:
        pair = batch["sequence_ids"].flatten()[pos]
    else:
        pair = pos // batch["input_ids"].shape[1]
    return list(zip(pair.tolist(), (pos - cls_pos[pair]).tolist(), strict=True))



@pytest.mark.parametrize("whole_word", [False, True])
def test_packed_pairs_give_each_pair_the_logits_of_its_own_row(corpus, tokenizer, whole_word):
    """Issue 37: pairs packed several to a row (block-diagonal attention, positions from 0 per pair, NSP
    from each pair's [CLS]) give, per pair, in eval mode and fp32, the MLM logits at its masked positions
    and the NSP logits of the same pairs each in a padded row of its own, within 1e-4; the masks and
    targets are the same too. And packing fills rows: fewer rows than pairs, less padding."""
    torch.manual_seed(0)
    model = M.Pretraining(M.model_from(M.new_architecture("tiny", len(tokenizer), 128, tokenizer.pad_token_id),
                                       "nsp", 0.1)).eval()
    streams = [make_stream(corpus, tokenizer, max_seq_len=96, batch_size=12, whole_word_mask=whole_word,
                           pack_pairs=pack, seed=3, short_seq_prob=0.6)
               for pack in (False, True)]
    rows = []
    with torch.no_grad():
        for plain, packed in itertools.islice(zip(*streams, strict=True), 6):
            outs = []
            for raw in (plain, packed):
                batch, counts = M.prepare(M.sparse_targets(raw), torch.device("cpu"))
                logits, nsp = model.logits(**{k: v for k, v in batch.items()
                                              if k not in ("masked_targets", "next_sentence_label")})
                order = sorted(range(len(logits)), key=pair_keys(batch).__getitem__)
                outs.append((sorted(pair_keys(batch)), logits[order], batch["masked_targets"][order], nsp,
                             batch["next_sentence_label"], counts))
                rows.append(len(batch["input_ids"]))
            (keys, logits, targets, nsp, labels, counts), (pkeys, plogits, ptargets, pnsp, plabels, pcounts) = outs
            assert keys == pkeys and torch.equal(targets, ptargets) and torch.equal(labels, plabels)
            assert torch.allclose(logits, plogits, atol=1e-4) and torch.allclose(nsp, pnsp, atol=1e-4)
            assert (counts["num_samples"], counts["num_tokens"], counts["num_attended"]) == \
                   (pcounts["num_samples"], pcounts["num_tokens"], pcounts["num_attended"])
            assert pcounts["num_computed"] <= counts["num_computed"]
    assert sum(rows[1::2]) < 0.8 * sum(rows[0::2])  # fewer rows



def test_a_step_reads_nothing_back_from_the_device_and_sums_the_stock_model_s_losses():
    """prepare() passes no mask for an unpadded batch and a 4-D boolean one for a padded batch (the
    linear layers see its real tokens only, the last layer's feed-forward only what the heads read):
    a forward + backward then reads nothing back from the device, and its loss sums are those of
    Hugging Face's own BertForPreTraining forward with the 2-D mask (which reads the mask back)."""
    import torch.nn.functional as F
    torch.manual_seed(0)
    model = M.Pretraining(M.model_from(M.new_architecture("tiny", 300, 32, 0), "nsp", 0.0))
    ids = torch.randint(5, 300, (4, 16))
    reads, originals = [0], {name: getattr(torch.Tensor, name) for name in ("__bool__", "item", "tolist")}

    def spy(name):
        def read(self, *a, **k):
            reads[0] += 1
            return originals[name](self, *a, **k)
        return read

    def forward_backward(forward):
        for name in originals:
            setattr(torch.Tensor, name, spy(name))
        reads[0] = 0
        try:
            out = forward()
            out.sum().backward()
        finally:
            for name, f in originals.items():
                setattr(torch.Tensor, name, f)
        return out.detach(), reads[0]

    def stock(raw):  # the Hugging Face model's own forward, its losses summed as ours
        out = model.hf(input_ids=raw["input_ids"], token_type_ids=raw["token_type_ids"],
                       attention_mask=raw["attention_mask"])
        chosen = raw["labels"] != -100
        logits, nsp = out.prediction_logits[chosen], out.seq_relationship_logits
        return torch.stack([F.cross_entropy(logits, raw["labels"][chosen], reduction="sum"),
                            (logits.argmax(-1) == raw["labels"][chosen]).sum().float(),
                            F.cross_entropy(nsp, raw["next_sentence_label"], reduction="sum"),
                            (nsp.argmax(-1) == raw["next_sentence_label"]).sum().float()])

    for padded in (False, True):
        mask = torch.ones(4, 16, dtype=torch.long)
        if padded:
            mask[1, 10:], mask[3, 5:] = 0, 0
        labels = torch.full((4, 16), -100)
        labels[0, 1], labels[1, 4], labels[2, 2], labels[3, 3] = 7, 8, 9, 10
        raw = {"input_ids": ids * mask, "token_type_ids": (torch.arange(16) > 7).long().expand(4, -1),
               "attention_mask": mask, "labels": labels, "next_sentence_label": torch.tensor([0, 1, 0, 1])}
        batch, counts = M.prepare(M.sparse_targets(dict(raw)), torch.device("cpu"))
        assert counts["num_tokens"] == int(mask.sum()) and ("attention_mask" in batch) == padded
        out, n_reads = forward_backward(lambda batch=batch: model(**batch))
        assert n_reads == 0, (padded, n_reads)
        reference, stock_reads = forward_backward(lambda raw=raw: stock(raw))
        assert stock_reads >= 1 and torch.allclose(out, reference, atol=1e-5), (out, reference)
    # packed pairs: the block-diagonal mask is built on the device from sequence_ids
    sequence = torch.tensor([[0] * 6 + [1] * 10, [2] * 9 + [-1] * 7, [3] * 16, [4] * 4 + [5] * 12])
    raw = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": (sequence >= 0).long(),
           "labels": labels, "position_ids": torch.zeros_like(ids), "sequence_ids": sequence,
           "next_sentence_label": torch.tensor([0, 1, 0, 1, 1, 0]), "cls_pos": torch.tensor([0, 6, 16, 32, 48, 52])}
    batch, counts = M.prepare(M.sparse_targets(raw), torch.device("cpu"))
    assert "attention_mask" not in batch and counts["num_attended"] == 36 + 100 + 81 + 256 + 16 + 144
    assert forward_backward(lambda: model(**batch))[1] == 0



@pytest.mark.slow  # dynamo compiles: seconds of work
def test_compile_does_not_recompile_as_batch_shapes_vary(corpus, tokenizer):
    """--compile: rows (the last batches of an epoch), masked-token counts and a mask or none vary;
    with the varying sizes marked dynamic dynamo compiles once per mask kind, never per size. Also
    the edge batches dynamo specialises: one row, and 0 or 1 masked tokens. Packed pairs: one graph."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()  # a backend that counts the graphs dynamo hands it, and runs them eagerly
    model = M.Pretraining(M.model_from(M.new_architecture("tiny", len(tokenizer), 64, tokenizer.pad_token_id),
                                       "nsp", 0.0))
    compiled = torch.compile(model, backend=counter)
    kinds = []
    raws = []
    for batch_size in (8, 5, 8, 3, 7, 2, 1):
        stream = make_stream(corpus, tokenizer, max_seq_len=64, batch_size=batch_size)
        raws += list(itertools.islice(stream, 2))
    for keep in (0, 1):  # batches with no masked token, and with one
        raw = {k: v.clone() if torch.is_tensor(v) else v for k, v in raws[0].items()}
        masked_at = (raw["labels"] != -100).nonzero()
        raw["labels"].fill_(-100)
        for row, col in masked_at[:keep].tolist():
            raw["labels"][row, col] = raws[0]["labels"][row, col]
        raws.append(raw)
    for raw in raws:
        batch, counts = M.prepare(M.sparse_targets(raw), torch.device("cpu"), dynamic=True)
        compiled(**batch)[0].backward()
        kinds.append((counts["num_samples"], counts["num_masked"], "attention_mask" in batch))
    assert len(set(kinds)) >= 11 and {mask for *_, mask in kinds} == {True, False}
    assert {1} <= {rows for rows, *_ in kinds} and {0, 1} <= {masked for _, masked, _ in kinds}, kinds
    assert counter.frame_count == 2  # without the marks: 3 here (dynamo's automatic dynamic after a recompile)
    # packed pairs: rows, width and pairs vary (a lone pair in one row too); every batch has sequence_ids
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    shapes = set()
    for batch_size in (8, 5, 1, 3, 16):
        stream = make_stream(corpus, tokenizer, max_seq_len=64, batch_size=batch_size, pack_pairs=True,
                             short_seq_prob=0.5)
        for raw in itertools.islice(stream, 2):
            batch, counts = M.prepare(M.sparse_targets(raw), torch.device("cpu"), dynamic=True)
            compiled(**batch)[0].backward()
            shapes.add((tuple(raw["input_ids"].shape), counts["num_samples"]))
    assert len({rows for (rows, _), _ in shapes}) >= 4 and {1} <= {n for _, n in shapes}, shapes
    assert counter.frame_count == 1


def stock_classifier(family):
    """A small BertForSequenceClassification, or ElectraForSequenceClassification (embeddings narrower than its
    layers: an ElectraModel's projection runs too), eval mode, eager attention."""
    from transformers import BertConfig, BertForSequenceClassification, ElectraConfig, ElectraForSequenceClassification
    torch.manual_seed(0)
    shape = {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
             "intermediate_size": 64, "max_position_embeddings": 32, "num_labels": 3, "attn_implementation": "eager"}
    if family == "electra":
        return ElectraForSequenceClassification(ElectraConfig(**shape, embedding_size=16)).eval()
    return BertForSequenceClassification(BertConfig(**shape)).eval()


@pytest.mark.parametrize("family", ["bert", "electra"])
def test_mean_pooling_is_the_mean_of_the_stock_last_layer_over_the_real_tokens(family):
    """classify(..., pooling="mean") reads the mean of BertModel's (ElectraModel's) last hidden states over each
    row's real tokens (padding left out), then the classifier's dropout and linear layer (ELECTRA's head): the
    same logits and gradients as that computed from the stock forward, on padded rows."""
    classifier = stock_classifier(family)
    lengths = torch.tensor([12, 5, 9, 2])
    attention_mask = (torch.arange(12)[None] < lengths[:, None]).long()
    input_ids = torch.randint(5, 100, (4, 12)) * attention_mask
    hidden = classifier.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    mean = (hidden * attention_mask[..., None]).sum(1) / lengths[:, None]
    stock = classifier.classifier(mean[:, None] if family == "electra" else mean)
    stock.square().sum().backward()
    stock_grads = {n: p.grad.clone() for n, p in classifier.named_parameters() if p.grad is not None}
    classifier.zero_grad()
    ours = M.classify(classifier, input_ids, torch.zeros_like(input_ids), attention_mask, "mean")
    ours.square().sum().backward()
    torch.testing.assert_close(ours, stock, atol=1e-5, rtol=1e-5)
    assert set(stock_grads) == {n for n, p in classifier.named_parameters() if p.grad is not None}  # no pooler
    for name, grad in stock_grads.items():
        torch.testing.assert_close(classifier.get_parameter(name).grad, grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("family", ["bert", "electra"])
def test_classify_gives_the_stock_classifier_logits_and_gradients_on_padded_rows(family):
    """model.classify (real tokens only, the last layer at [CLS]) is BertForSequenceClassification's (and
    ElectraForSequenceClassification's) forward: the same logits and the same gradients, in fp32, for rows of
    different lengths and for rows without padding."""
    classifier = stock_classifier(family)
    lengths = torch.tensor([12, 5, 9, 2])
    attention_mask = (torch.arange(12)[None] < lengths[:, None]).long()
    input_ids = torch.randint(5, 100, (4, 12)) * attention_mask
    token_type_ids = (torch.arange(12)[None] >= (lengths[:, None] // 2)).long() * attention_mask
    for rows in (slice(None), slice(0, 1)):  # padded rows, and one row with no padding at all
        args = input_ids[rows], token_type_ids[rows], attention_mask[rows]
        classifier.zero_grad()
        stock = classifier(input_ids=args[0], token_type_ids=args[1], attention_mask=args[2]).logits
        stock.square().sum().backward()
        stock_grads = {n: p.grad.clone() for n, p in classifier.named_parameters() if p.grad is not None}
        classifier.zero_grad()
        ours = M.classify(classifier, *args)
        ours.square().sum().backward()
        torch.testing.assert_close(ours, stock, atol=1e-5, rtol=1e-5)
        for name, p in classifier.named_parameters():
            if name in stock_grads:
                torch.testing.assert_close(p.grad, stock_grads[name], atol=1e-5, rtol=1e-4, msg=name)
