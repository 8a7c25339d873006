"""LAViTeR's visual-textual alignment (VTA) encoders: E_I for images, E_T for captions.

Both give what DAMSM compares (vldist/losses/damsm.py): local vectors (image regions, words) and
one global vector (image, sentence), all of the same size D.

    E_I: a CNN trunk; local = 1x1 conv of a mid-level map (InceptionV3: Mixed_6e, 17x17 = 289
         regions), global = linear of the last block, average-pooled. The trunk is a list of
         `blocks`, so that a training phase can freeze its first N.
    E_T: a transformer (the paper: 1 layer, 8 heads, 15 words), or AttnGAN's bi-LSTM (the
         baseline of Tables 2-3).

Images enter in [-1, 1] (the generator's tanh range, so that generated and real images share one
encoder) and are resized to the encoder's input size, as AttnGAN's encoder resizes to 299.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vldist.models.common import length_mask, masked_mean, sinusoidal_positions


def _conv_bn_relu(cin: int, cout: int, stride: int) -> nn.Sequential:
    conv = nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False)  # BN follows: no bias
    # He init keeps the signal's scale through the ReLUs: phase 1 runs this trunk frozen, its batch
    # norm in eval mode, and with torch's default init the last block's output is ~1e-3 of its input.
    nn.init.kaiming_normal_(conv.weight, mode="fan_in", nonlinearity="relu")
    return nn.Sequential(conv, nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class AlignmentImageEncoder(nn.Module):
    """blocks[:local_after] give the local map, the rest the global one; then the two projections."""

    input_size: int
    blocks: nn.ModuleList

    def __init__(
        self,
        blocks: list[nn.Module],
        local_after: int,
        local_channels: int,
        global_channels: int,
        dim: int,
        input_size: int,
    ):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.local_after, self.input_size, self.global_channels = local_after, input_size, global_channels
        self.local_projection = nn.Conv2d(local_channels, dim, kernel_size=1, bias=False)  # AttnGAN's emb_features
        self.global_projection = nn.Linear(global_channels, dim)  # AttnGAN's emb_cnn_code

    def projections(self) -> list[nn.Module]:
        return [self.local_projection, self.global_projection]

    def trunk(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """images (B, 3, H, W) in [-1, 1] -> (the local map, the last block's map pooled (B, C))."""
        if images.shape[-1] != self.input_size or images.shape[-2] != self.input_size:
            images = F.interpolate(
                images, size=(self.input_size, self.input_size), mode="bilinear", align_corners=False
            )
        x = images
        for i, block in enumerate(self.blocks):
            if i == self.local_after:
                local = x
            x = block(x)
        return local, x.mean(dim=(2, 3))

    def project(self, local: torch.Tensor, pooled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The trunk's outputs -> (regions (B, R, D), image (B, D))."""
        return self.local_projection(local).flatten(2).transpose(1, 2), self.global_projection(pooled)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """images (B, 3, H, W) in [-1, 1] -> (regions (B, R, D), image (B, D))."""
        return self.project(*self.trunk(images))


def small_image_encoder(dim: int = 256, input_size: int = 64) -> AlignmentImageEncoder:
    """A CPU-sized CNN for the embedded 64-px scenes: 7 blocks, local map 8x8 = 64 regions after
    the sixth, global after the seventh (shaped like InceptionV3's: a stem, then wider blocks)."""
    blocks = [
        _conv_bn_relu(3, 16, 1),
        _conv_bn_relu(16, 32, 2),
        _conv_bn_relu(32, 32, 1),
        _conv_bn_relu(32, 64, 2),
        _conv_bn_relu(64, 64, 1),
        _conv_bn_relu(64, 128, 2),
        _conv_bn_relu(128, 256, 2),
    ]
    return AlignmentImageEncoder(
        blocks, local_after=6, local_channels=128, global_channels=256, dim=dim, input_size=input_size
    )


INCEPTION_BLOCKS = (
    "Conv2d_1a_3x3",
    "Conv2d_2a_3x3",
    "Conv2d_2b_3x3",
    "maxpool1",
    "Conv2d_3b_1x1",
    "Conv2d_4a_3x3",
    "maxpool2",
    "Mixed_5b",
    "Mixed_5c",
    "Mixed_5d",
    "Mixed_6a",
    "Mixed_6b",
    "Mixed_6c",
    "Mixed_6d",
    "Mixed_6e",
    "Mixed_7a",
    "Mixed_7b",
    "Mixed_7c",
)


def inception_image_encoder(dim: int = 256, weights: str | None = None) -> AlignmentImageEncoder:
    """The paper's E_I: torchvision's InceptionV3, local = Mixed_6e (768 x 17 x 17), global =
    Mixed_7c (2048) pooled, at 299 px. weights: a torchvision weights name (downloads unless
    cached), a local state-dict file of torchvision's inception_v3 (its `fc.*`/`AuxLogits.*` are
    ignored), or None (random). Blocks keep torchvision's order; the first five are the stem
    convolutions (max-pools are parameter-free and not counted as blocks)."""
    local = weights is not None and Path(weights).is_file()
    import torchvision  # here, not at the top: it loads torch._dynamo and sympy (~0.9 s), which --help need not pay

    net = torchvision.models.inception_v3(
        weights=None if local else weights, aux_logits=True, init_weights=weights is None, transform_input=False
    )  # inputs are already in [-1, 1]
    if local:
        state = torch.load(weights, map_location="cpu", weights_only=True)
        missing, unexpected = net.load_state_dict(state, strict=False)
        wrong = [k for k in [*missing, *unexpected] if not k.startswith(("fc.", "AuxLogits."))]
        if wrong:
            raise ValueError(
                f"{weights} is not a state dict of torchvision's inception_v3 ({len(wrong)} entries "
                f"differ, e.g. {wrong[0]}): save model.state_dict() of torchvision.models.inception_v3"
            )
    stem = {"maxpool1": 3, "maxpool2": 6}
    blocks = [getattr(net, name) for name in INCEPTION_BLOCKS]
    # Max-pools sit inside the stem block before them, so `blocks[:5]` are exactly the 5 stem convs.
    merged: list[nn.Module] = []
    for name, block in zip(INCEPTION_BLOCKS, blocks, strict=True):
        if name in stem:
            merged[-1] = nn.Sequential(merged[-1], block)
        else:
            merged.append(block)
    local_after = merged.index(net.Mixed_6e) + 1
    return AlignmentImageEncoder(
        merged, local_after=local_after, local_channels=768, global_channels=2048, dim=dim, input_size=299
    )


class TransformerSentenceEncoder(nn.Module):
    """E_T (Eqs. 1-3): word embedding + positions, post-LN transformer layers with a padding mask,
    sentence = mean of the real words' vectors. The official code has no padding mask and averages
    padding in: a defect this encoder does not copy."""

    def __init__(
        self,
        vocab_size: int,
        dim: int = 256,
        heads: int = 8,
        layers: int = 1,
        max_words: int = 15,
        dropout: float = 0.1,
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim, padding_idx=0)
        self.register_buffer("positions", sinusoidal_positions(max_words, dim), persistent=False)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, dropout=dropout, batch_first=True)
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, words: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """words (B, T) ids without <start>/<end>, lengths (B,) -> (words (B, T, D), sentence (B, D))."""
        real = length_mask(lengths, words.shape[1])
        x = self.embed(words) + self.positions[: words.shape[1]]
        x = self.layers(x, src_key_padding_mask=~real)
        return x, masked_mean(x, real)


class BiLSTMSentenceEncoder(nn.Module):
    """AttnGAN's RNN_ENCODER, the DAMSM baseline: 300-d embeddings, dropout, a bi-LSTM of D/2 per
    direction; words = its outputs, sentence = the last hidden states of both directions."""

    def __init__(self, vocab_size: int, dim: int = 256, word_dim: int = 300, dropout: float = 0.5):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, word_dim, padding_idx=0)
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)  # as AttnGAN
        self.dropout = nn.Dropout(dropout)
        self.lstm = nn.LSTM(word_dim, dim // 2, batch_first=True, bidirectional=True)

    def forward(self, words: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        packed = nn.utils.rnn.pack_padded_sequence(
            self.dropout(self.embed(words)), lengths.clamp(min=1).cpu(), batch_first=True, enforce_sorted=False
        )
        out, (hidden, _) = self.lstm(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=words.shape[1])
        return out, torch.cat([hidden[0], hidden[1]], dim=-1)


def build_image_encoder(name: str, dim: int, weights: str | None, input_size: int) -> AlignmentImageEncoder:
    if name == "inception_v3":
        return inception_image_encoder(dim, weights)
    if weights:
        raise ValueError(
            "model.image_weights is for image_encoder=inception_v3; the small CNN starts from random weights"
        )
    return small_image_encoder(dim, input_size)


def build_text_encoder(name: str, vocab_size: int, dim: int, heads: int, layers: int, max_words: int) -> nn.Module:
    if name == "bilstm":
        return BiLSTMSentenceEncoder(vocab_size, dim)
    return TransformerSentenceEncoder(vocab_size, dim, heads, layers, max_words)
