"""A port of the official VSRN training step (KunpengLi1994/VSRN) to current PyTorch, for timing.

Ported from the official repository (mirror: /work/.mirror/KunpengLi1994+VSRN), same layers, same
layouts, same order of operations:

- GCN_lib/Rs_GCN.py: `RsGCN` (Rs_GCN with bn_layer=True): g, theta, phi and W as Conv1d(k=1) on
  (B, D, N), R = theta^T phi / N, W's BatchNorm1d starting at zero, the residual.
- model.py: `l2norm` (no epsilon), `EncoderImagePrecompAttn` (data_name coco_precomp: fc + l2norm,
  4 Rs_GCN, l2norm, GRU, the last hidden state, l2norm; returns GCN_img_emd for the captioner),
  `EncoderText` (Embedding, packed GRU, the output at the last real word, l2norm),
  `ContrastiveLoss` (cosine, max_violation), `OfficialVSRN.train_step` = VSRN.train_emb (forward
  both encoders, the caption loss on GCN_img_emd, the retrieval loss, their sum, backward,
  clip_grad_norm, Adam step).
- models/EncoderRNN.py, models/DecoderRNN.py (mode 'train', teacher forcing), models/Attention.py,
  models/S2VTAttModel.py: the caption model, GRU cells, dropouts as in train.py's options.
- misc/utils.py: `LanguageModelCriterion` (NLL summed over masked tokens, divided by the batch).

What differs, and why:
- No Variable / .cuda(): everything runs where its inputs are (the harness measures on CPU).
  `nn.init.constant` is `nn.init.constant_`, NLLLoss(reduce=False) is reduction='none'.
- EncoderText gathers with a LongTensor index built on the input's device instead of .cuda().
- The decoder's max_len (official default 60) is set by the caller to the batch's caption length,
  so both codes decode the same number of steps as vldist (T - 1).
- The caption encoder's dim_vid (official: 2048, the paper's embed size) is the embed size, so the
  port also runs at the demo's embed of 256.
- The official optimizer's parameter list holds the caption model's parameters twice (encoder +
  decoder, then caption_model); current torch warns about duplicates, and Adam would update them
  twice. Here each parameter is in the list once.
- EncoderRNN reshapes where the original views (current torch keeps elementwise outputs in the
  permuted (B, N, D) layout, which view rejects; the torch of 2019 made them contiguous).
- `rnn_dropout_p` on the one-layer GRUs has no effect (torch warns); kept, as in the original.
- The data loader's order (captions sorted by length, longest first, for pack_padded_sequence) is
  the caller's: `train_step` expects lengths in descending order.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence


def l2norm(x):
    # Over dim 1, as written: on the (B, N, D) region tensors that is over the regions, not the
    # features (the official code's own behaviour, kept; it costs the same).
    norm = torch.pow(x, 2).sum(dim=1, keepdim=True).sqrt()
    return torch.div(x, norm)


class RsGCN(nn.Module):
    def __init__(self, in_channels: int, inter_channels: int):
        super().__init__()
        self.in_channels, self.inter_channels = in_channels, inter_channels
        self.g = nn.Conv1d(in_channels, inter_channels, kernel_size=1, stride=1, padding=0)
        self.W = nn.Sequential(
            nn.Conv1d(inter_channels, in_channels, kernel_size=1, stride=1, padding=0), nn.BatchNorm1d(in_channels)
        )
        nn.init.constant_(self.W[1].weight, 0)
        nn.init.constant_(self.W[1].bias, 0)
        self.theta = nn.Conv1d(in_channels, inter_channels, kernel_size=1, stride=1, padding=0)
        self.phi = nn.Conv1d(in_channels, inter_channels, kernel_size=1, stride=1, padding=0)

    def forward(self, v):
        """v: (B, D, N)."""
        batch_size = v.size(0)
        g_v = self.g(v).view(batch_size, self.inter_channels, -1).permute(0, 2, 1)
        theta_v = self.theta(v).view(batch_size, self.inter_channels, -1).permute(0, 2, 1)
        phi_v = self.phi(v).view(batch_size, self.inter_channels, -1)
        R = torch.matmul(theta_v, phi_v)
        R_div_C = R / R.size(-1)
        y = torch.matmul(R_div_C, g_v).permute(0, 2, 1).contiguous()
        y = y.view(batch_size, self.inter_channels, *v.size()[2:])
        return self.W(y) + v


class EncoderImagePrecompAttn(nn.Module):
    def __init__(self, img_dim: int, embed_size: int):
        super().__init__()
        self.fc = nn.Linear(img_dim, embed_size)
        r = np.sqrt(6.0) / np.sqrt(self.fc.in_features + self.fc.out_features)
        self.fc.weight.data.uniform_(-r, r)
        self.fc.bias.data.fill_(0)
        self.img_rnn = nn.GRU(embed_size, embed_size, 1, batch_first=True)
        self.Rs_GCN_1 = RsGCN(embed_size, embed_size)
        self.Rs_GCN_2 = RsGCN(embed_size, embed_size)
        self.Rs_GCN_3 = RsGCN(embed_size, embed_size)
        self.Rs_GCN_4 = RsGCN(embed_size, embed_size)

    def forward(self, images):
        fc_img_emd = l2norm(self.fc(images))  # data_name != 'f30k_precomp'
        gcn = fc_img_emd.permute(0, 2, 1)  # -> B, D, N
        gcn = self.Rs_GCN_4(self.Rs_GCN_3(self.Rs_GCN_2(self.Rs_GCN_1(gcn))))
        gcn = gcn.permute(0, 2, 1)  # -> B, N, D
        gcn = l2norm(gcn)
        _, hidden_state = self.img_rnn(gcn)
        features = l2norm(hidden_state[0])
        return features, gcn


class EncoderText(nn.Module):
    def __init__(self, vocab_size: int, word_dim: int, embed_size: int, num_layers: int = 1):
        super().__init__()
        self.embed_size = embed_size
        self.embed = nn.Embedding(vocab_size, word_dim)
        self.rnn = nn.GRU(word_dim, embed_size, num_layers, batch_first=True)
        self.embed.weight.data.uniform_(-0.1, 0.1)

    def forward(self, x, lengths):
        x = self.embed(x)
        packed = pack_padded_sequence(x, lengths, batch_first=True)
        out, _ = self.rnn(packed)
        padded = pad_packed_sequence(out, batch_first=True)
        index = torch.as_tensor(lengths, device=x.device).view(-1, 1, 1)
        index = index.expand(x.size(0), 1, self.embed_size) - 1
        out = torch.gather(padded[0], 1, index).squeeze(1)
        return l2norm(out)


class ContrastiveLoss(nn.Module):
    def __init__(self, margin: float = 0.0, max_violation: bool = False):
        super().__init__()
        self.margin, self.max_violation = margin, max_violation

    def forward(self, im, s):
        scores = im.mm(s.t())
        diagonal = scores.diag().view(im.size(0), 1)
        d1 = diagonal.expand_as(scores)
        d2 = diagonal.t().expand_as(scores)
        cost_s = (self.margin + scores - d1).clamp(min=0)
        cost_im = (self.margin + scores - d2).clamp(min=0)
        mask = (torch.eye(scores.size(0)) > 0.5).to(scores.device)
        cost_s = cost_s.masked_fill_(mask, 0)
        cost_im = cost_im.masked_fill_(mask, 0)
        if self.max_violation:
            cost_s = cost_s.max(1)[0]
            cost_im = cost_im.max(0)[0]
        return cost_s.sum() + cost_im.sum()


class EncoderRNN(nn.Module):
    def __init__(self, dim_vid, dim_hidden, input_dropout_p=0.2, rnn_dropout_p=0.5, n_layers=1):
        super().__init__()
        self.dim_hidden = dim_hidden
        self.vid2hid = nn.Linear(dim_vid, dim_hidden)
        self.input_dropout = nn.Dropout(input_dropout_p)
        self.rnn = nn.GRU(dim_hidden, dim_hidden, n_layers, batch_first=True, dropout=rnn_dropout_p)
        nn.init.xavier_normal_(self.vid2hid.weight)

    def forward(self, vid_feats):
        batch_size, seq_len, dim_vid = vid_feats.size()
        # reshape, not view: current torch keeps l2norm's output in the permuted layout, where the
        # torch of 2019 returned it contiguous
        vid_feats = self.input_dropout(self.vid2hid(vid_feats.reshape(-1, dim_vid)))
        vid_feats = vid_feats.view(batch_size, seq_len, self.dim_hidden)
        self.rnn.flatten_parameters()
        return self.rnn(vid_feats)


class Attention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim
        self.linear1 = nn.Linear(dim * 2, dim)
        self.linear2 = nn.Linear(dim, 1, bias=False)

    def forward(self, hidden_state, encoder_outputs):
        batch_size, seq_len, _ = encoder_outputs.size()
        hidden_state = hidden_state.unsqueeze(1).repeat(1, seq_len, 1)
        inputs = torch.cat((encoder_outputs, hidden_state), 2).view(-1, self.dim * 2)
        o = self.linear2(torch.tanh(self.linear1(inputs)))
        alpha = F.softmax(o.view(batch_size, seq_len), dim=1)
        return torch.bmm(alpha.unsqueeze(1), encoder_outputs).squeeze(1)


class DecoderRNN(nn.Module):
    def __init__(self, vocab_size, max_len, dim_hidden, dim_word, input_dropout_p=0.1, rnn_dropout_p=0.1):
        super().__init__()
        self.dim_hidden, self.max_length = dim_hidden, max_len
        self.input_dropout = nn.Dropout(input_dropout_p)
        self.embedding = nn.Embedding(vocab_size, dim_word)
        self.attention = Attention(dim_hidden)
        self.rnn = nn.GRU(dim_hidden + dim_word, dim_hidden, 1, batch_first=True, dropout=rnn_dropout_p)
        self.out = nn.Linear(dim_hidden, vocab_size)
        nn.init.xavier_normal_(self.out.weight)

    def forward(self, encoder_outputs, encoder_hidden, targets):
        """mode='train' of the original: teacher forcing over max_len - 1 steps."""
        decoder_hidden = encoder_hidden
        seq_logprobs = []
        self.rnn.flatten_parameters()
        targets_emb = self.embedding(targets)
        for i in range(self.max_length - 1):
            current_words = targets_emb[:, i, :]
            context = self.attention(decoder_hidden.squeeze(0), encoder_outputs)
            decoder_input = torch.cat([current_words, context], dim=1)
            decoder_input = self.input_dropout(decoder_input).unsqueeze(1)
            decoder_output, decoder_hidden = self.rnn(decoder_input, decoder_hidden)
            logprobs = F.log_softmax(self.out(decoder_output.squeeze(1)), dim=1)
            seq_logprobs.append(logprobs.unsqueeze(1))
        return torch.cat(seq_logprobs, 1)


class S2VTAttModel(nn.Module):
    def __init__(self, encoder, decoder):
        super().__init__()
        self.encoder, self.decoder = encoder, decoder

    def forward(self, vid_feats, target_variable):
        encoder_outputs, encoder_hidden = self.encoder(vid_feats)
        return self.decoder(encoder_outputs, encoder_hidden, target_variable)


class LanguageModelCriterion(nn.Module):
    def __init__(self):
        super().__init__()
        self.loss_fn = nn.NLLLoss(reduction="none")

    def forward(self, logits, target, mask):
        batch_size = logits.shape[0]
        target = target[:, : logits.shape[1]]
        mask = mask[:, : logits.shape[1]]
        loss = self.loss_fn(logits.contiguous().view(-1, logits.shape[2]), target.contiguous().view(-1))
        return torch.sum(loss * mask.contiguous().view(-1)) / batch_size


class OfficialVSRN(nn.Module):
    """model.py's VSRN (train.py's options: dim_hidden 512, dim_word 300, dropouts 0.2 / 0.5)."""

    def __init__(
        self,
        vocab_size: int,
        max_len: int,
        img_dim: int = 2048,
        embed_size: int = 2048,
        word_dim: int = 300,
        dim_hidden: int = 512,
        dim_word: int = 300,
        margin: float = 0.2,
        grad_clip: float = 2.0,
        learning_rate: float = 2e-4,
    ):
        super().__init__()
        self.grad_clip = grad_clip
        self.img_enc = EncoderImagePrecompAttn(img_dim, embed_size)
        self.txt_enc = EncoderText(vocab_size, word_dim, embed_size)
        encoder = EncoderRNN(embed_size, dim_hidden, input_dropout_p=0.2, rnn_dropout_p=0.5)  # dim_vid = embed
        decoder = DecoderRNN(vocab_size, max_len, dim_hidden, dim_word, input_dropout_p=0.2, rnn_dropout_p=0.5)
        self.caption_model = S2VTAttModel(encoder, decoder)
        self.crit = LanguageModelCriterion()
        self.criterion = ContrastiveLoss(margin=margin, max_violation=True)
        self.params = list(self.parameters())  # each once (see the module docstring)
        self.optimizer = torch.optim.Adam(self.params, lr=learning_rate)

    def train_step(self, images, captions, lengths, caption_labels, caption_masks) -> float:
        """VSRN.train_emb: images (B, N, F), captions (B, T) sorted by length (longest first),
        lengths (list), caption_labels = captions, caption_masks (B, T) float."""
        cap_emb = self.txt_enc(captions, lengths)
        img_emb, gcn_img_emd = self.img_enc(images)
        self.optimizer.zero_grad()
        seq_probs = self.caption_model(gcn_img_emd, caption_labels)
        caption_loss = self.crit(seq_probs, caption_labels[:, 1:], caption_masks[:, 1:])
        self.optimizer.zero_grad()
        retrieval_loss = self.criterion(img_emb, cap_emb)
        loss = retrieval_loss + caption_loss
        loss.backward()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.optimizer.step()
        return float(loss.detach())
