"""
The model of pretrain_ddp.py, in a file of its own to copy into another repo: a Hugging Face BertForPreTraining
(or BertForMaskedLM) that computes only the real work, with the same weights and the same math per pair.

    import model
    hf = model.model_from(model.new_architecture("mini", vocab_size=30522, max_seq_len=128, pad_id=0), "nsp", 0.1)
    net = model.Pretraining(hf)                          # hf.save_pretrained(...) stays a plain BERT
    batch, counts = model.prepare(model.sparse_targets(collated_batch), device)
    mlm_loss_sum, mlm_correct, nsp_loss_sum, nsp_correct = net(**batch)

ELECTRA (--objective electra): model_from(new_architecture("tiny", ..., generator_size=0.25), "electra", 0.0) is
an ElectraPair, a stock ElectraForPreTraining and ElectraForMaskedLM sharing their embeddings, which
Pretraining trains by replaced-token detection; its sums are (generator MLM loss, correct, discriminator loss,
correct over the real tokens).

ModernBERT (--arch modernbert): new_architecture("tiny", ..., arch="modernbert") makes a stock
ModernBertForMaskedLM, which Pretraining trains by mlm as it does BERT (encode_modern: pre-LayerNorm, GeGLU, RoPE
at each sequence's positions, the local layers' band inside each sequence, every layer on the real tokens only).

Top to bottom: the sizes and the model's construction, the packed and unpadded forward (Pretraining; ELECTRA's
replaced_token_detection and its sampler), classify (fine-tuning's forward), BERT's and ModernBERT's encoders
(encode, encode_modern), its input contract (sparse_targets, the collate function that turns a batch of
data_stream.py's into what the forward reads; prepare, which puts it on the device), its FLOPs and the peak of
the GPU that runs them (MFU). It needs torch and transformers only.
"""
import os
import re

import torch
import torch.nn.functional as F

# ----------------------------------------------------------------------------- sizes and construction

# BERT sizes of Turc et al. 2019 (tiny..medium) and of the BERT paper (base, large):
# (layers, hidden, attention heads); the feed-forward width is 4 x hidden.
MODEL_SIZES = {"tiny": (2, 128, 2), "mini": (4, 256, 4), "small": (4, 512, 8),
               "medium": (8, 512, 8), "base": (12, 768, 12), "large": (24, 1024, 16)}

# ModernBERT (--arch modernbert; Warner et al. 2024) at a BERT size's name: the same layers, width and heads, and
# a GeGLU whose three matrices hold as many weights as BERT's two-matrix feed-forward (8/3 x hidden a branch, as
# LLaMA sizes its SwiGLU; to a multiple of 16), so that a name means about BERT's parameters and FLOPs. Its
# attention: a band of 128 tokens (64 each side) in every layer but each third (global, from the first on).
GLOBAL_EVERY = 3
LOCAL_WINDOW = 128


def glu_width(hidden):
    return 16 * round(8 * hidden / 3 / 16)


# ELECTRA (Clark et al. 2020): the generator's width as a fraction of the discriminator's (the paper found 1/4 to
# 1/2 best: a stronger generator makes the task too hard), and the weight of the discriminator's mean loss in the
# sum that trains both (the paper's 50: its per-token binary loss is ~50x smaller than the generator's MLM loss)
GENERATOR_SIZE = 0.25
DISC_WEIGHT = 50.0


def new_architecture(model_size, vocab_size, max_seq_len, pad_id, generator_size=None, arch="bert"):
    """The BertConfig fields (no dropout) of a model built from scratch; runs keep them in their config. With a
    generator_size (ELECTRA): ElectraConfig's, the discriminator's at model_size plus the generator's shape.
    arch "modernbert": ModernBertConfig's, with "arch" to tell them apart."""
    layers, hidden, heads = MODEL_SIZES[model_size]
    if arch == "modernbert":
        # RoPE has no table of positions: 8,192 (ModernBERT's) is only what the config promises; no [CLS] or
        # [SEP] ids (the model reads none; its defaults would name tokens past a small vocabulary)
        return {"arch": "modernbert", "vocab_size": vocab_size, "hidden_size": hidden, "num_hidden_layers": layers,
                "num_attention_heads": heads, "intermediate_size": glu_width(hidden),
                "max_position_embeddings": max(8192, max_seq_len), "pad_token_id": pad_id,
                "bos_token_id": None, "eos_token_id": None, "cls_token_id": None, "sep_token_id": None,
                "global_attn_every_n_layers": GLOBAL_EVERY, "local_attention": LOCAL_WINDOW}
    architecture = {"vocab_size": vocab_size, "hidden_size": hidden, "num_hidden_layers": layers,
                    "num_attention_heads": heads, "intermediate_size": 4 * hidden,
                    "max_position_embeddings": max(512, max_seq_len), "pad_token_id": pad_id}
    if generator_size is not None:
        # The generator has the discriminator's depth at a fraction of its width (the paper's), heads of the
        # discriminator's head size where they fit; both read the same embeddings, of the discriminator's width
        width = max(1, round(hidden * generator_size))
        gen_heads = max(1, width // (hidden // heads))
        while width % gen_heads:
            gen_heads -= 1
        architecture["embedding_size"] = hidden
        architecture["generator"] = {"hidden_size": width, "num_attention_heads": gen_heads,
                                     "intermediate_size": 4 * width}
    return architecture


def size_name(architecture):
    """'tiny' .. 'large' for the sizes of MODEL_SIZES, else e.g. '6L-384H-12A'."""
    a = architecture
    shape = (a["num_hidden_layers"], a["hidden_size"], a["num_attention_heads"])
    modern = "modernbert" in (a.get("arch"), a.get("model_type"))  # a run's architecture or a config's dict
    feed_forward = glu_width(a["hidden_size"]) if modern else 4 * a["hidden_size"]
    for name, size in MODEL_SIZES.items():
        if size == shape and a.get("intermediate_size", feed_forward) == feed_forward:
            return name
    return "{}L-{}H-{}A".format(*shape)


def family_name(architecture):
    return "ModernBERT" if architecture.get("arch") == "modernbert" else \
        "ELECTRA" if "generator" in architecture else "BERT"


def model_from(architecture, objective, dropout):
    """A fresh BertForPreTraining (nsp), BertForMaskedLM (mlm), ElectraPair (electra) or ModernBertForMaskedLM
    (an architecture of arch modernbert, mlm) of that architecture (seed torch first)."""
    from transformers import BertConfig, BertForMaskedLM, BertForPreTraining  # here: data workers import this file
    if architecture.get("arch") == "modernbert":
        from transformers import ModernBertConfig, ModernBertForMaskedLM
        fields = {k: v for k, v in architecture.items() if k != "arch"}
        return ModernBertForMaskedLM(ModernBertConfig(**fields, embedding_dropout=dropout, attention_dropout=dropout,
                                                      mlp_dropout=dropout))
    if objective == "electra":
        return ElectraPair(architecture, dropout)
    config = BertConfig(**{**architecture, "hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout})
    return (BertForPreTraining if objective == "nsp" else BertForMaskedLM)(config)


class ElectraPair(torch.nn.Module):
    """ELECTRA's two models, trained together, each a stock transformers class: the discriminator, an
    ElectraForPreTraining (what one fine-tunes), and the generator, an ElectraForMaskedLM of a fraction of its
    width that reads the discriminator's embeddings (token, position and type, and their LayerNorm: the same
    modules), its output projection tied to the token embeddings (the paper's sharing). save_pretrained writes
    the discriminator to a folder and the generator to its generator/; both load with the Auto classes."""

    def __init__(self, architecture, dropout):
        super().__init__()
        from transformers import ElectraConfig, ElectraForMaskedLM, ElectraForPreTraining
        body = {k: v for k, v in architecture.items() if k != "generator"}
        drop = {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
        self.discriminator = ElectraForPreTraining(ElectraConfig(**body, **drop))
        self.generator = ElectraForMaskedLM(ElectraConfig(**{**body, **architecture["generator"]}, **drop))
        embeddings = self.discriminator.electra.embeddings
        self.generator.electra.embeddings = embeddings
        self.generator.generator_lm_head.weight = embeddings.word_embeddings.weight
        self.config = self.discriminator.config

    def save_pretrained(self, folder, **kwargs):
        self.discriminator.save_pretrained(folder, **kwargs)
        self.generator.save_pretrained(os.path.join(folder, "generator"), **kwargs)


def new_optimizer(raw_model, lr, weight_decay):
    """AdamW with BERT's settings; no decay on biases and LayerNorm."""
    decay = [p for n, p in raw_model.named_parameters() if p.ndim >= 2 and "LayerNorm" not in n]
    no_decay = [p for n, p in raw_model.named_parameters() if p.ndim < 2 or "LayerNorm" in n]
    # fused: one kernel for all parameters (measured 6.6x faster than the for-loop on this CPU too)
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.98),
                             eps=1e-6, fused=True)


# ----------------------------------------------------------------------------- the forward: real work only

class Pretraining(torch.nn.Module):
    """A Hugging Face BERT run with its own submodules, computing only what its heads read (the module
    tree stays the Hugging Face model's: `self.hf.save_pretrained` output loads anywhere unchanged):
    - the MLM head only at masked positions (the vocabulary projection is most of a small BERT's FLOPs);
    - every layer's linear layers, LayerNorms and dropouts on the real tokens only (real_pos; MosaicBERT's
      unpadding): padding costs only the attention, which runs in the rows, masked;
    - rows may hold several pairs (data_stream's packing): sequence_ids give a block-diagonal mask,
      position_ids restart per pair, the NSP head reads each pair's [CLS] (cls_pos) through the pooler;
    - the last layer's attention output and feed-forward only for the rows the heads read (MosaicBERT).
    Per pair the math of BertForPreTraining on a row of its own (tests: 1e-4). Returns per-batch sums:
    (mlm loss, mlm correct, nsp loss, nsp correct)."""

    def __init__(self, hf_model):
        super().__init__()
        self.hf = hf_model

    def forward(self, input_ids, token_type_ids, masked_pos, masked_targets, attention_mask=None,
                position_ids=None, sequence_ids=None, real_pos=None, cls_pos=None, next_sentence_label=None,
                copied_row=None):
        if isinstance(self.hf, ElectraPair):
            if sequence_ids is not None:
                attention_mask = sequence_ids[:, None, :, None] == sequence_ids[:, None, None, :]
            return replaced_token_detection(self.hf, input_ids, token_type_ids, masked_pos, masked_targets,
                                            attention_mask, position_ids, real_pos, copied_row, self.training)
        logits, nsp_logits = self.logits(input_ids, token_type_ids, masked_pos, attention_mask, position_ids,
                                         sequence_ids, real_pos, cls_pos)
        mlm_loss = F.cross_entropy(logits, masked_targets, reduction="sum")
        mlm_correct = (logits.argmax(-1) == masked_targets).sum()
        if next_sentence_label is None:
            zero = mlm_loss.new_zeros(())
            return torch.stack([mlm_loss, mlm_correct.float(), zero, zero])
        nsp_loss = F.cross_entropy(nsp_logits, next_sentence_label, reduction="sum")
        nsp_correct = (nsp_logits.argmax(-1) == next_sentence_label).sum()
        return torch.stack([mlm_loss, mlm_correct.float(), nsp_loss, nsp_correct.float()])

    def logits(self, input_ids, token_type_ids, masked_pos, attention_mask=None, position_ids=None,
               sequence_ids=None, real_pos=None, cls_pos=None):
        """(MLM logits at masked_pos, NSP logits at cls_pos or None); both index the real tokens in row
        order (real_pos: where those are in the flattened rows; None: every position is real)."""
        if sequence_ids is not None:
            attention_mask = sequence_ids[:, None, :, None] == sequence_ids[:, None, None, :]
        if hasattr(self.hf, "model"):  # a ModernBertForMaskedLM: mlm only (no pooler, no NSP head)
            x = encode_modern(self.hf.model, input_ids, masked_pos, attention_mask, position_ids, real_pos,
                              self.training)
            return self.hf.decoder(self.hf.head(x)).float(), None
        reads = masked_pos if cls_pos is None else torch.cat([masked_pos, cls_pos])
        x = encode(self.hf.bert, input_ids, token_type_ids, reads, attention_mask, position_ids, real_pos,
                   self.training)
        logits = self.hf.cls.predictions(x[:len(masked_pos)]).float()
        if cls_pos is None:
            return logits, None
        pooled = self.hf.bert.pooler(x[len(masked_pos):, None])  # the pooler reads position 0
        return logits, self.hf.cls.seq_relationship(pooled).float()


def replaced_token_detection(pair, input_ids, token_type_ids, masked_pos, masked_targets, attention_mask,
                             position_ids, real_pos, copied_row, training):
    """ELECTRA's step on an mlm batch, each model computing only what its loss reads: the generator's MLM
    at the masked positions, its samples put there, and the discriminator's loss at every real token: was it
    replaced? (A sample that equals the original counts as not replaced, as in the paper.) Per sequence the
    math of the stock ElectraForMaskedLM and ElectraForPreTraining (tests: 1e-4). Returns per-batch sums:
    (generator MLM loss, its correct, discriminator loss, its correct over the real tokens); the trainer
    divides the first by the masked tokens, the second by the real ones, and weighs it by DISC_WEIGHT."""
    generator, discriminator = pair.generator, pair.discriminator
    x = encode(generator.electra, input_ids, token_type_ids, masked_pos, attention_mask, position_ids, real_pos,
               training)
    logits = generator.generator_lm_head(generator.generator_predictions(x)).float()
    mlm_loss, probs = SoftmaxCrossEntropy.apply(logits, masked_targets)
    mlm_correct = (logits.argmax(-1) == masked_targets).sum()
    with torch.no_grad():  # no gradient flows through the samples (the paper's): the generator learns MLM only
        sampled = sample(probs)
        real = masked_targets >= 0  # sparse_targets pads a batch's masked positions to two with target -100
        flat = input_ids.flatten()
        in_rows = masked_pos if real_pos is None else real_pos[masked_pos]
        # added, not assigned: a padding entry (position 0, adding 0) never overwrites a real one there
        fakes = flat.index_put((in_rows,), torch.where(real, sampled - flat[in_rows], 0), accumulate=True)
        n = len(flat) if real_pos is None else len(real_pos)
        replaced = torch.zeros(n, device=flat.device).index_put_(
            (masked_pos,), ((sampled != masked_targets) & real).float(), accumulate=True)
        # a one-row batch's copy (sparse_targets: for torch.compile) holds no sample: only the row counts
        weights = None if copied_row is None else (torch.arange(n, device=flat.device) < copied_row).float()
    x = encode(discriminator.electra, fakes.view_as(input_ids), token_type_ids, None, attention_mask, position_ids,
               real_pos, training)
    disc_logits = discriminator.discriminator_predictions(x).float()
    disc_loss = F.binary_cross_entropy_with_logits(disc_logits, replaced, weights, reduction="sum")
    disc_right = (disc_logits > 0) == replaced.bool()
    disc_correct = disc_right.sum() if weights is None else (disc_right * weights).sum()
    return torch.stack([mlm_loss, mlm_correct.float(), disc_loss, disc_correct.float()])


class SoftmaxCrossEntropy(torch.autograd.Function):
    """F.cross_entropy(logits, targets, reduction="sum") (targets -100 ignored) that also returns the softmax
    it computes (no gradient): its backward reads the same probabilities, and the generator's samples are
    drawn from them: one exp over the vocabulary where log_softmax, its backward and a sample took three."""

    @staticmethod
    def forward(ctx, logits, targets):
        log_probs = F.log_softmax(logits, -1)  # one fused pass, as cross_entropy's
        probs = log_probs.exp()
        real = targets >= 0
        index = targets.clamp(min=0)[:, None]
        loss = -(log_probs.gather(1, index).squeeze(1) * real).sum()
        ctx.save_for_backward(probs, index, real)
        ctx.mark_non_differentiable(probs)
        return loss, probs

    @staticmethod
    def backward(ctx, grad_loss, _):
        probs, index, real = ctx.saved_tensors
        scale = (real * grad_loss)[:, None]  # d loss / d logits = softmax - one-hot(target), per real row
        return (probs * scale).scatter_add_(1, index, -scale), None


def sample(probs, block=128):
    """One token per row of probs (each sums to 1), drawn with torch's RNG (a checkpoint keeps its state: a
    resume draws the same), on the device (no host sync), by the inverse of the cumulative distribution with
    one uniform number per row, in two levels: the row's blocks of `block` tokens, then the tokens of the block
    drawn. (Gumbel-max, or torch.multinomial's exponentials, draw a number per vocabulary entry, and one
    cumulative sum over the vocabulary is sequential: each cost a tiny ELECTRA's CPU step a sixth more.)"""
    rows, vocab = probs.shape
    if vocab % block:
        probs = F.pad(probs, (0, -vocab % block))  # the padding has probability 0
    probs = probs.view(rows, -1, block)
    block_probs = probs.sum(-1)
    block_cdf = block_probs.cumsum(-1)
    u = torch.rand(rows, 1, device=probs.device, dtype=probs.dtype) * block_cdf[:, -1:]  # the sum: 1, rounded
    chosen = torch.searchsorted(block_cdf, u).clamp_(max=block_cdf.shape[1] - 1)
    u = u - (block_cdf.gather(1, chosen) - block_probs.gather(1, chosen))  # what is left inside the block
    inner_cdf = probs[torch.arange(rows, device=probs.device), chosen.squeeze(1)].cumsum(-1)
    token = chosen * block + torch.searchsorted(inner_cdf, u).clamp_(max=block - 1)
    return token.squeeze(1).clamp_(max=vocab - 1)


def classify(classifier, input_ids, token_type_ids, attention_mask, pooling="cls"):
    """A Hugging Face BertForSequenceClassification's (Electra's, ModernBert's) logits, computed as
    Pretraining computes its own: the real tokens only; attention_mask is a tokenizer's (rows, width) of 1s and
    0s. pooling "cls": the last layer only at each row's [CLS], through BERT's pooler or ELECTRA's head: the
    same math as classifier(...).logits (tests: 1e-5). "mean": the classifier reads the mean of the last layer
    over each row's real tokens (BERT's pooler unused): an mlm run trains neither [CLS] nor the pooler, and
    every token's state is what its loss trained."""
    if pooling not in ("cls", "mean"):
        raise ValueError(f"pooling must be cls or mean, not {pooling!r}")
    modern = hasattr(classifier, "model")  # a ModernBertForSequenceClassification (config.classifier_pooling)
    electra = hasattr(classifier, "electra")
    body = classifier.model if modern else classifier.electra if electra else classifier.bert
    lengths = attention_mask.sum(1)
    cls_pos = lengths.cumsum(0) - lengths  # each row's [CLS] among the real tokens
    real_pos = None
    mask = None
    if int(lengths.sum()) < attention_mask.numel():  # padding: compute the real tokens only
        real_pos = attention_mask.flatten().nonzero().squeeze(1)
        mask = attention_mask.bool()[:, None, None, :]
    reads = cls_pos if pooling == "cls" else torch.arange(int(lengths.sum()), device=input_ids.device)
    if modern:
        x = encode_modern(body, input_ids, reads, mask, None, real_pos, classifier.training)
    else:
        x = encode(body, input_ids, token_type_ids, reads, mask, None, real_pos, classifier.training)
    if pooling == "cls":
        pooled = x if electra or modern else body.pooler(x[:, None])  # the pooler reads position 0
    else:
        row = torch.repeat_interleave(torch.arange(len(lengths), device=x.device), lengths)
        sums = x.new_zeros(len(lengths), x.shape[1], dtype=torch.float32).index_add_(0, row, x.float())
        pooled = (sums / lengths.clamp(min=1)[:, None]).to(x.dtype)  # summed in fp32 under autocast too
    if modern:  # its head (dense, gelu, LayerNorm), dropout, projection
        return classifier.classifier(classifier.drop(classifier.head(pooled)))
    if electra:  # its head (dropout, dense, gelu, dropout, projection) reads position 0
        return classifier.classifier(pooled[:, None])
    return classifier.classifier(classifier.dropout(pooled))


def encode(bert, input_ids, token_type_ids, reads, attention_mask=None, position_ids=None, real_pos=None,
           training=False):
    """A Hugging Face BertModel's (or ElectraModel's) hidden states at reads (indices into the real tokens, in
    row order; None: all): every layer on the real tokens only (real_pos: where they are in the flattened rows;
    None: every position is real), attention in the rows under attention_mask (4-D, boolean), the last layer
    only at reads."""
    x = bert.embeddings(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids)
    if hasattr(bert, "embeddings_project"):  # an ElectraModel narrower than its embeddings (a generator)
        x = bert.embeddings_project(x)
    rows = x.shape[:2]
    x = x.flatten(0, 1) if real_pos is None else x.flatten(0, 1).index_select(0, real_pos)
    *layers, last = bert.encoder.layer
    for layer in layers:
        x = encoder_layer(layer, x, rows, real_pos, attention_mask, training)
    return encoder_layer(last, x, rows, real_pos, attention_mask, training, reads)


def encoder_layer(layer, x, rows, real_pos, mask, training, reads=None):
    """A BertLayer on the real tokens x (n, hidden), attention in the rows; with reads (indices into
    x) only those rows come out: the last layer."""
    att = layer.attention.self
    shape = (att.num_attention_heads, att.attention_head_size)
    a = F.scaled_dot_product_attention(*(in_rows(f(x), rows, real_pos, shape) for f in (att.query, att.key, att.value)),
                                       attn_mask=mask, dropout_p=att.dropout.p if training else 0.0)
    a = a.transpose(1, 2).flatten(2).flatten(0, 1)[slice(None) if real_pos is None else real_pos]
    if reads is not None:
        a, x = a.index_select(0, reads), x.index_select(0, reads)
    a = layer.attention.output(a, x)  # dense, dropout, LayerNorm of the residual
    return layer.output(layer.intermediate(a), a)


def in_rows(t, rows, real_pos, heads_and_size):
    """The real tokens' (n, ...) projections as attention reads them: (rows, heads, width, head size), zeros at the
    padding (BERT's and ModernBERT's layers alike)."""
    if real_pos is not None:
        t = t.new_zeros(rows[0] * rows[1], *t.shape[1:]).index_copy(0, real_pos, t)
    return t.view(*rows, *heads_and_size).transpose(1, 2)


def encode_modern(body, input_ids, reads, attention_mask=None, position_ids=None, real_pos=None, training=False):
    """A Hugging Face ModernBertModel's final (normed) states at reads, as encode computes BERT's: every layer on
    the real tokens only, attention in the rows under attention_mask (4-D boolean; a row's sequences apart), RoPE
    at position_ids (None: each row from 0; packed sequences restart at 0), the local layers' band of
    config.sliding_window each side inside it (row distance is position distance within a sequence)."""
    ids = input_ids.flatten() if real_pos is None else input_ids.flatten().index_select(0, real_pos)
    x = body.embeddings(input_ids=ids)  # token embeddings, LayerNorm, dropout: of the real tokens
    rows, width = input_ids.shape
    positions = torch.arange(width, device=ids.device).repeat(rows) if position_ids is None else position_ids.flatten()
    positions = positions if real_pos is None else positions.index_select(0, real_pos)
    rope = {kind: rotation(*body.rotary_emb(x, positions[None], kind)) for kind in set(body.config.layer_types)}
    near = torch.arange(width, device=ids.device)
    band = (near[:, None] - near[None, :]).abs() <= body.config.sliding_window
    # every position attends to itself at least: a padding position far from its row's tokens would have no key
    # (torch's CPU kernels give such a row zeros; not every kernel promises that, and a NaN there would reach the
    # real tokens' gradients through attention's backward)
    local = band if attention_mask is None else (attention_mask & band) | (near[:, None] == near[None, :])
    masks = {"full_attention": attention_mask, "sliding_attention": local}
    *layers, last = body.layers
    for layer in layers:
        kind = layer.attention_type
        x = modern_layer(layer, x, (rows, width), real_pos, masks[kind], rope[kind], training)
    kind = last.attention_type
    return body.final_norm(modern_layer(last, x, (rows, width), real_pos, masks[kind], rope[kind], training, reads))


def rotation(cos, sin):
    """RoPE's angles as modern_layer applies them, (n, 1, 1, head size) each: cos, and sin with its first half
    negated (the angles repeat in the two halves: rotate_half(t) * sin == t.roll(half) * signed sin)."""
    half = sin.shape[-1] // 2
    signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], -1)
    return cos[0, :, None, None, :], signed_sin[0, :, None, None, :]


def modern_layer(layer, x, rows, real_pos, mask, rope, training, reads=None):
    """A ModernBertEncoderLayer (pre-LayerNorm, rotary attention, GeGLU) on the real tokens x (n, hidden),
    attention in the rows; with reads (indices into x) only those rows come out: the last layer."""
    att = layer.attn
    heads, size = att.config.num_attention_heads, att.head_dim
    qkv = att.Wqkv(layer.attn_norm(x)).view(len(x), 3, heads, size)
    # transformers' apply_rotary_pos_emb, in fp32, on the queries and keys at once: rotate_half(t) * sin is
    # t's halves swapped (one roll) times sin with its first half negated (rotation): 3 ops, not 5
    cos, signed_sin = rope
    qk = qkv[:, :2].float()
    q, k = torch.addcmul(qk * cos, qk.roll(size // 2, -1), signed_sin).to(qkv.dtype).unbind(1)
    v = qkv[:, 2]
    a = F.scaled_dot_product_attention(*(in_rows(t, rows, real_pos, (heads, size)) for t in (q, k, v)), attn_mask=mask,
                                       dropout_p=att.attention_dropout if training else 0.0)
    a = a.transpose(1, 2).flatten(2).flatten(0, 1)[slice(None) if real_pos is None else real_pos]
    if reads is not None:
        a, x = a.index_select(0, reads), x.index_select(0, reads)
    x = x + att.out_drop(att.Wo(a))
    return x + layer.mlp(layer.mlp_norm(x))


# ----------------------------------------------------------------------------- its input contract

def sparse_targets(batch):
    """The DataLoader's collate_fn (it runs in the worker; its tensors are pinned with the rest): masked
    positions and targets instead of labels, the real tokens' positions, a 4-D boolean mask where a
    batch pads (nothing the model reads back: no host sync), and its host counts. torch.compile
    specialises sizes 0 and 1, so a batch of one row or pair gets a copy of its row (nothing read in it;
    copied_row: the row's real tokens, which come first) and an NSP label -100 (ignored), and masked positions
    are padded to two with target -100."""
    labels, mask = batch.pop("labels"), batch.pop("attention_mask")
    batch.update(counts_of(mask, batch.get("sequence_ids"), batch.get("next_sentence_label")))
    if "next_sentence_label" in batch and "cls_pos" not in batch:  # a pair a row: its [CLS] starts it
        batch["cls_pos"] = torch.arange(len(labels)) * labels.shape[1]
    if len(labels) == 1:
        batch["copied_row"] = torch.tensor(batch["num_tokens"])  # ELECTRA's loss reads every real token: the row's
        labels = torch.cat([labels, torch.full_like(labels, -100)])
        mask = torch.cat([mask, mask])
        for name in ("input_ids", "token_type_ids", "position_ids", "sequence_ids"):
            if name in batch:
                batch[name] = torch.cat([batch[name], batch[name]])
    if "next_sentence_label" in batch and len(batch["cls_pos"]) == 1:
        batch["next_sentence_label"] = torch.cat([batch["next_sentence_label"], torch.tensor([-100])])
        batch["cls_pos"] = torch.cat([batch["cls_pos"], torch.zeros(1, dtype=torch.long)])
    labels = labels.flatten()
    masked_pos = (labels != -100).nonzero().squeeze(1)
    batch["num_masked"] = len(masked_pos)
    masked_targets = labels[masked_pos]
    if len(masked_pos) < 2:
        masked_pos = torch.cat([masked_pos, torch.zeros(2 - len(masked_pos), dtype=masked_pos.dtype)])
        masked_targets = torch.cat([masked_targets, torch.full((2 - len(masked_targets),), -100)])
    batch["masked_pos"], batch["masked_targets"] = masked_pos, masked_targets
    if batch["num_tokens"] < mask.numel():  # padding: the model computes the real tokens (real_pos) only
        index = mask.flatten().cumsum(0) - 1  # a real token's place among the real ones
        batch["real_pos"] = mask.flatten().nonzero().squeeze(1)
        batch["masked_pos"] = index[masked_pos]
        if "cls_pos" in batch:
            batch["cls_pos"] = index[batch["cls_pos"]]
        if "sequence_ids" not in batch:
            batch["attention_mask"] = mask.bool()[:, None, None, :]
    return batch


def counts_of(mask, sequence_ids, nsp_labels):
    """A batch's samples (pairs, or mlm rows), real tokens, positions in its rows and attention's (query,
    key) pairs within a sample, sum of length^2 (the FLOPs of the real work, not of the padding), and those
    pairs within ModernBERT's local band (LOCAL_WINDOW / 2 each side)."""
    lengths = mask.sum(1) if sequence_ids is None else torch.bincount(sequence_ids[sequence_ids >= 0])
    near = (lengths - 1).clamp(min=0, max=LOCAL_WINDOW // 2)  # each side: L + 2 x sum over d <= near of (L - d)
    return {"num_samples": len(mask) if nsp_labels is None else len(nsp_labels), "num_tokens": int(lengths.sum()),
            "num_computed": mask.numel(), "num_attended": int((lengths**2).sum()),
            "num_attended_local": int((lengths + near * (2 * lengths - near - 1)).sum())}


# --compile: these sizes vary. Marked dynamic, they are symbolic from the first compile on: one graph (two:
# with and without a mask), not one per new size until dynamo's recompile limit sends the model to eager.
DYNAMIC_DIMS = {"input_ids": (0, 1), "token_type_ids": (0, 1), "position_ids": (0, 1), "sequence_ids": (0, 1),
                "attention_mask": (0, 3), "masked_pos": (0,), "masked_targets": (0,), "next_sentence_label": (0,),
                "cls_pos": (0,), "real_pos": (0,)}
# host counts (counts_of)
COUNTS = ("num_samples", "num_masked", "num_tokens", "num_computed", "num_attended", "num_attended_local")


def prepare(batch, device, dynamic=False):
    """A batch from the loader on the device (non-blocking: pinned on CUDA); returns it and its
    host counts (COUNTS: known without a sync)."""
    counts = {k: batch.pop(k) for k in COUNTS}
    on_device = {k: v.to(device, non_blocking=True) for k, v in batch.items() if k != "cursor"}
    for name, dims in DYNAMIC_DIMS.items() if dynamic else ():
        for dim in dims if name in on_device else ():
            torch._dynamo.maybe_mark_dynamic(on_device[name], dim)
    return on_device, counts


# ----------------------------------------------------------------------------- its FLOPs, and a GPU's peak (MFU)

def train_flops(hf_model, counts):
    """Training FLOPs of the real work of one micro-batch (forward + backward = 3x forward): of its
    tokens, not its padding, and of attention within each sample (MFU counts what was worth computing).
    ELECTRA: the generator's encoder and head, and the discriminator's encoder and head on every token."""
    def encoder(config):
        layers, hidden = config.num_hidden_layers, config.hidden_size
        matrices = 3 if config.model_type == "modernbert" else 2  # GeGLU: two in, one out
        per_token = 2 * layers * (4 * hidden * hidden + matrices * hidden * config.intermediate_size)
        # QK^T and AV over (query, key) pairs: ModernBERT's local layers over those within LOCAL_WINDOW's band
        local = sum(kind == "sliding_attention" for kind in getattr(config, "layer_types", None) or [])
        pairs = (layers - local) * counts["num_attended"] + local * counts["num_attended_local"]
        return counts["num_tokens"] * per_token + 2 * 2 * hidden * pairs

    config = hf_model.config
    hidden, vocab = config.hidden_size, config.vocab_size
    if not isinstance(hf_model, ElectraPair):
        return 3 * (encoder(config) + 2 * (hidden * hidden + hidden * vocab) * counts["num_masked"])
    gen = hf_model.generator.config
    width, embedding = gen.hidden_size, gen.embedding_size
    project = 2 * embedding * width * counts["num_tokens"] if width != embedding else 0
    gen_head = 2 * (width * embedding + embedding * vocab) * counts["num_masked"]
    disc_head = 2 * (hidden * hidden + hidden) * counts["num_tokens"]
    return 3 * (encoder(gen) + project + gen_head + encoder(config) + disc_head)


# Dense peak FLOP/s from the data sheets: (bf16/fp16 tensor cores, TF32, fp32; V100 and T4: no TF32). A key
# matches whole words of the name, the longest first ("H100 PCIe" before "H100"; "T400" is no T4): an unknown
# GPU gets no MFU rather than a wrong one.
GPU_PEAKS = {"GB200": (2500e12, 1250e12, 80e12), "B200": (2250e12, 1100e12, 75e12),
             "H200 NVL": (835e12, 418e12, 60e12), "H200": (989e12, 494e12, 67e12), "GH200": (989e12, 494e12, 67e12),
             "H100 PCIe": (756e12, 378e12, 51e12), "H100 NVL": (835e12, 418e12, 60e12),
             "H100": (989e12, 494e12, 67e12), "A100": (312e12, 156e12, 19.5e12), "A10G": (70e12, 35e12, 31.2e12),
             "A10": (125e12, 62.5e12, 31.2e12), "L40S": (362e12, 183e12, 91.6e12), "L40": (181e12, 90.5e12, 90.5e12),
             "L4": (121e12, 60e12, 30.3e12), "RTX 4090": (165e12, 82.6e12, 82.6e12),
             "RTX 3090": (71e12, 35.6e12, 35.6e12), "V100 PCIe": (112e12, 14e12, 14e12),
             "V100": (125e12, 15.7e12, 15.7e12), "T4": (65e12, 8.1e12, 8.1e12)}


def gpu_peak(name, amp_dtype, tf32):
    """The dense peak of the GPU called `name` for the math the run does, or None when unknown."""
    words = " " + " ".join(re.split(r"[\s_-]+", name.upper())) + " "
    for key in sorted(GPU_PEAKS, key=len, reverse=True):
        if f" {key.upper()} " in words:
            return GPU_PEAKS[key][0 if amp_dtype is not None else 1 if tf32 else 2]
    return None
