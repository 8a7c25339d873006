"""VSRN's image encoder: region projection, region relationship reasoning, global semantic reasoning.

V  = l2norm(W_f f + b_f)                 Eq. 1, f: bottom-up region features
V* = RRR^n(V), l2-normalised             Sec. 3.2 (n = 0..4 layers)
I  = GRU(V*_1 .. V*_k), last memory m_k   Sec. 3.3; or the mean of V* (the 'Mean-pool' ablation)
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from vldist.models.common import l2norm, last_hidden_gru, masked_mean, xavier_linear
from vldist.models.gcn import RegionRelationReasoning
from vldist.models.projection import Projection


class RegionReasoningEncoder(nn.Module):
    def __init__(
        self,
        region_dim: int,
        embed_size: int,
        rrr_layers: int = 4,
        affinity_norm: str = "count",
        global_reasoning: Literal["gru", "mean"] = "gru",
        gcn_kernel: str = "auto",
        gcn_products: str = "auto",
    ):
        super().__init__()
        self.region_projection = xavier_linear(Projection(region_dim, embed_size))  # W_f
        self.rrr = nn.ModuleList(
            RegionRelationReasoning(embed_size, affinity_norm, gcn_kernel, gcn_products) for _ in range(rrr_layers)
        )
        self.global_reasoning = global_reasoning
        self.gru = nn.GRU(embed_size, embed_size, batch_first=True) if global_reasoning == "gru" else None

    def forward(self, regions: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """regions (B, K, F), mask (B, K) with real regions first -> (I (B, D), V* (B, K, D))."""
        keep = mask.unsqueeze(-1)
        v = l2norm(self.region_projection(regions)) * keep
        for layer in self.rrr:
            v = layer(v, mask)
        v_star = l2norm(v) * keep
        if self.gru is not None:
            image = last_hidden_gru(self.gru, v_star, mask.sum(dim=1))
        else:
            image = masked_mean(v_star, mask)
        return l2norm(image), v_star
