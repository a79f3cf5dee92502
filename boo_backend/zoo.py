"""A zoo of tiny, randomly initialised models of real architectures, for tests and benchmarks.

    from boo_backend.zoo import MODELS
    model, batch = MODELS["gpt2"]()
    loss = model(**batch).loss

Each factory builds its model from a small Hugging Face config (2 layers, hidden 32-64,
vocabulary 128, sequence 16, batch 2, images 32x32) and a batch of keyword arguments that
includes `labels`, so that `model(**batch).loss` is a training loss and `.logits` the
prediction. `MODELS[name](batch=B, seq=L)` gives the same model with a batch of another size
(for dynamic shapes): L tokens for text models (up to MAX_POSITIONS), L // 2 decoder tokens
for encoder-decoders, 25 * L audio samples; image models keep their image size (a symbolic
image side needs guards Dynamo does not check) and vary the batch only. Nothing is
downloaded: weights are random, seeded, so a factory returns the same model and batch every
time. Dropout is off (every probability 0.0) so that eager and
compiled runs compare exactly; attention is PyTorch SDPA (transformers' default).

transformers is a test/bench extra, not a dependency of boo: it is imported inside the
factories. `cnn` needs only torch.
"""

from __future__ import annotations

import types
from typing import Callable

import torch
import torch.nn as nn

BATCH, SEQ, VOCAB, IMAGE, CLASSES = 2, 16, 128, 32, 4
MAX_POSITIONS = 256  # the longest sequence a text model takes
# Set up front: transformers fills in problem_type on the first call otherwise, and that
# change to the config makes Dynamo compile the model a second time.
SINGLE = "single_label_classification"


def _generator(seed: int, batch: int, seq: int) -> torch.Generator:
    """Seeded by the size too: every size gets data of its own."""
    return torch.Generator().manual_seed(seed + 7919 * batch + seq)


def _tokens(seed: int = 1, batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=_generator(seed, batch, seq))


def _images(seed: int = 1, batch: int = BATCH, size: int = IMAGE) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=_generator(seed, batch, size))


def _class_labels(seed: int = 2, batch: int = BATCH) -> torch.Tensor:
    return torch.randint(0, CLASSES, (batch,), generator=_generator(seed, batch, 0))



def _build(model_cls, config) -> nn.Module:
    torch.manual_seed(0)
    return model_cls(config)  # attention: transformers' default, SDPA


def _causal_lm(model_cls, config, batch: int, seq: int) -> tuple[nn.Module, dict]:
    ids = _tokens(batch=batch, seq=seq)
    return _build(model_cls, config), {"input_ids": ids, "labels": ids.clone()}


def gpt2(batch: int = BATCH, seq: int = SEQ):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=MAX_POSITIONS, n_embd=32, n_layer=2, n_head=4,
                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return _causal_lm(GPT2LMHeadModel, cfg, batch, seq)


def llama(batch: int = BATCH, seq: int = SEQ):
    """Grouped-query attention: 4 query heads share 2 key/value heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
                      attention_dropout=0.0)
    return _causal_lm(LlamaForCausalLM, cfg, batch, seq)


def qwen2(batch: int = BATCH, seq: int = SEQ):
    """Grouped-query attention with biased q/k/v projections and tied embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=MAX_POSITIONS,
                      attention_dropout=0.0, tie_word_embeddings=True)
    return _causal_lm(Qwen2ForCausalLM, cfg, batch, seq)


def bert(batch: int = BATCH, seq: int = SEQ):
    """Padding in the second sequence: a real attention mask (not all ones)."""
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=MAX_POSITIONS, num_labels=CLASSES, problem_type=SINGLE,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, seq - 4:] = 0
    inputs = {"input_ids": _tokens(batch=batch, seq=seq), "attention_mask": mask, "labels": _class_labels(batch=batch)}
    return _build(BertForSequenceClassification, cfg), inputs


def distilbert(batch: int = BATCH, seq: int = SEQ):
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    cfg = DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                           max_position_embeddings=MAX_POSITIONS, num_labels=CLASSES, problem_type=SINGLE,
                           dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0)
    return _build(DistilBertForSequenceClassification, cfg), {"input_ids": _tokens(batch=batch, seq=seq),
                                                              "labels": _class_labels(batch=batch)}


def t5(batch: int = BATCH, seq: int = SEQ):
    """Encoder-decoder with relative position buckets and RMS norm (no bias, no mean)."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                   num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    inputs = {"input_ids": _tokens(1, batch, seq), "labels": _tokens(3, batch, max(seq // 2, 2))}
    return _build(T5ForConditionalGeneration, cfg), inputs


def bart(batch: int = BATCH, seq: int = SEQ):
    """Encoder-decoder with learned positions, LayerNorm and GELU."""
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                     decoder_ffn_dim=64, max_position_embeddings=MAX_POSITIONS, dropout=0.0, attention_dropout=0.0,
                     activation_dropout=0.0, classifier_dropout=0.0,
                     pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    inputs = {"input_ids": _tokens(1, batch, seq), "labels": _tokens(3, batch, max(seq // 2, 2))}
    return _build(BartForConditionalGeneration, cfg), inputs


def vit(batch: int = BATCH, seq: int = SEQ):
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=IMAGE, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=64, num_labels=CLASSES, problem_type=SINGLE,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return _build(ViTForImageClassification, cfg), {"pixel_values": _images(batch=batch),
                                                    "labels": _class_labels(batch=batch)}


def resnet(batch: int = BATCH, seq: int = SEQ):
    """BatchNorm: training updates the running statistics, inference uses them."""
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                       layer_type="basic", num_labels=CLASSES, problem_type=SINGLE)
    images = _images(batch=batch)
    return _build(ResNetForImageClassification, cfg), {"pixel_values": images, "labels": _class_labels(batch=batch)}


def convnext(batch: int = BATCH, seq: int = SEQ):
    """Depthwise 7x7 convolutions, channels-last LayerNorm, layer scale."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    cfg = ConvNextConfig(num_channels=3, patch_size=4, num_stages=2, hidden_sizes=[16, 32], depths=[1, 1],
                         num_labels=CLASSES, problem_type=SINGLE, drop_path_rate=0.0)
    images = _images(batch=batch)
    return _build(ConvNextForImageClassification, cfg), {"pixel_values": images, "labels": _class_labels(batch=batch)}


def swin(batch: int = BATCH, seq: int = SEQ):
    """Windowed attention with shifted windows and relative position bias."""
    from transformers import SwinConfig, SwinForImageClassification

    cfg = SwinConfig(image_size=IMAGE, patch_size=4, num_channels=3, embed_dim=16, depths=[1, 1],
                     num_heads=[2, 4], window_size=4, mlp_ratio=2.0, num_labels=CLASSES, problem_type=SINGLE,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0)
    return _build(SwinForImageClassification, cfg), {"pixel_values": _images(batch=batch),
                                                     "labels": _class_labels(batch=batch)}


class SmallCNN(nn.Module):
    """Conv2d -> BatchNorm2d -> ReLU -> AvgPool2d -> Flatten -> Linear; the loss is the mean
    log-sum-exp of the logits (`labels` is accepted and ignored, to fit the protocol)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AvgPool2d(4),
            nn.Flatten(), nn.Linear(8 * (IMAGE // 4) ** 2, CLASSES),
        )

    def forward(self, pixel_values, labels=None):
        logits = self.body(pixel_values)
        return types.SimpleNamespace(loss=logits.logsumexp(-1).mean(), logits=logits)


def falcon(batch: int = BATCH, seq: int = SEQ):
    """Multi-query attention; its fused QKV split reads `x[..., [-2], :]`, a negative index
    whose backward is an index_put."""
    from transformers import FalconConfig, FalconForCausalLM

    cfg = FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       hidden_dropout=0.0, attention_dropout=0.0, new_decoder_architecture=False,
                       multi_query=True)
    return _causal_lm(FalconForCausalLM, cfg, batch, seq)


def wav2vec2(batch: int = BATCH, seq: int = SEQ):
    """Audio: a strided conv feature extractor and a weight-normed positional conv."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    cfg = Wav2Vec2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4, num_labels=CLASSES,
        problem_type=SINGLE, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0,
        classifier_proj_size=16, do_stable_layer_norm=False,
    )
    audio = torch.randn(batch, 25 * seq, generator=_generator(1, batch, seq))
    return _build(Wav2Vec2ForSequenceClassification, cfg), {
        "input_values": audio, "labels": _class_labels(batch=batch)
    }


def mixtral(batch: int = BATCH, seq: int = SEQ):
    """Mixture of experts: each layer's router takes the top 2 of 4 experts per token (topk
    and a sort of the chosen experts in every layer; IREE once gave two sorts of one shape
    the same indices), the experts run as batched matmuls."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                        num_experts_per_tok=2, max_position_embeddings=MAX_POSITIONS, attention_dropout=0.0,
                        router_jitter_noise=0.0)
    cfg._experts_implementation = "batched_mm"
    return _causal_lm(MixtralForCausalLM, cfg, batch, seq)


def funnel(batch: int = BATCH, seq: int = SEQ):
    """Funnel transformer: the sequence is pooled between blocks (average pooling that rounds
    up, ceil_mode, so odd lengths keep their last token) and upsampled again, with relative
    positional attention (einsums and a shift by reshape)."""
    from transformers import FunnelConfig, FunnelForMaskedLM

    cfg = FunnelConfig(vocab_size=VOCAB, d_model=32, n_head=4, d_head=8, d_inner=64, block_sizes=[1, 1],
                       num_decoder_layers=1, max_position_embeddings=MAX_POSITIONS, hidden_dropout=0.0,
                       attention_dropout=0.0, activation_dropout=0.0)
    ids = _tokens(batch=batch, seq=seq)
    return _build(FunnelForMaskedLM, cfg), {"input_ids": ids, "labels": _tokens(3, batch, seq)}


def cnn(batch: int = BATCH, seq: int = SEQ):
    torch.manual_seed(0)
    return SmallCNN(), {"pixel_values": _images(batch=batch), "labels": _class_labels(batch=batch)}


MODELS: dict[str, Callable[[], tuple[nn.Module, dict]]] = {
    "cnn": cnn,
    "gpt2": gpt2,
    "bert": bert,
    "distilbert": distilbert,
    "llama": llama,
    "qwen2": qwen2,
    "t5": t5,
    "bart": bart,
    "vit": vit,
    "resnet": resnet,
    "convnext": convnext,
    "swin": swin,
    "falcon": falcon,
    "wav2vec2": wav2vec2,
    "mixtral": mixtral,
    "funnel": funnel,
}
