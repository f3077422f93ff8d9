"""Top-k routers: which experts each token goes to, and with what weight.

Glossary: T tokens, H hidden, E experts, K experts per token (top-k), G expert groups.

Two score functions, both computed in fp32:

* ``"softmax"`` (Mixtral, Qwen): ``scores = softmax(logits)``; the top-k scores, divided
  by their sum when ``normalize=True``, are the token's expert weights.
* ``"sigmoid"`` (DeepSeek-V3): ``scores = sigmoid(logits)``. Experts are *selected* by
  ``scores + bias`` (``bias``: a buffer updated outside autograd for auxiliary-loss-free
  load balancing, ``update_bias``) but *weighted* by the scores themselves, normalized over
  the chosen K and times ``scale``. With ``num_groups > 1`` selection is group-limited:
  each group of E/G experts is rated by the sum of its two best biased scores, the
  ``topk_groups`` best groups stay, the experts of the others are never chosen.

Everything is device tensor work: no host sync, no shape that depends on the data.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["Routing", "TopKRouter", "load_balancing_loss"]


class Routing(NamedTuple):
    """A router's decision for T tokens over E experts."""

    probs: torch.Tensor  # [T, E] fp32: each chosen expert's weight, 0 elsewhere
    routing_map: torch.Tensor  # [T, E] bool: the chosen experts (K per token)
    scores: torch.Tensor  # [T, E] fp32: softmax or sigmoid of the logits (aux losses)


class TopKRouter(torch.nn.Module):
    """``Routing`` of ``x [T, H]``: a bias-free linear to E logits, then top-k.

    Args:
        hidden: H.
        num_experts: E.
        top_k: K, ``1 <= K <= E``.
        score: ``"softmax"`` or ``"sigmoid"`` (module doc).
        normalize: divide the chosen K weights by their sum (default: True for sigmoid,
            as DeepSeek-V3; False for softmax, as Switch and Qwen1.5/2-MoE. Mixtral and
            Qwen3 renormalize their softmax top-k: pass ``normalize=True``).
        scale: multiplies the weights (DeepSeek-V3's ``routed_scaling_factor``).
        num_groups, topk_groups: group-limited selection (sigmoid or softmax alike);
            ``num_groups`` must divide E, ``topk_groups * E / num_groups >= K``.
        score_bias: keep a selection bias ``[E]`` (fp32 buffer, zeros); DeepSeek-V3
            updates it from the expert loads (``update_bias``).
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, *, score: str = "softmax",
                 normalize: bool | None = None, scale: float = 1.0, num_groups: int = 1,
                 topk_groups: int = 1, score_bias: bool = False,
                 device=None, dtype=None):
        super().__init__()
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"TopKRouter: score must be 'softmax' or 'sigmoid', got {score!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"TopKRouter: top_k must be in [1, num_experts={num_experts}], "
                             f"got {top_k}")
        if num_groups < 1 or num_experts % num_groups:
            raise ValueError(f"TopKRouter: num_groups ({num_groups}) must divide num_experts "
                             f"({num_experts})")
        if num_groups > 1 and not (1 <= topk_groups <= num_groups
                                   and topk_groups * (num_experts // num_groups) >= top_k):
            raise ValueError(f"TopKRouter: topk_groups ({topk_groups}) groups of "
                             f"{num_experts // num_groups} experts must hold top_k ({top_k}) "
                             f"experts, with 1 <= topk_groups <= num_groups ({num_groups})")
        self.num_experts, self.top_k, self.score = num_experts, top_k, score
        self.normalize = score == "sigmoid" if normalize is None else normalize
        self.scale, self.num_groups, self.topk_groups = float(scale), num_groups, topk_groups
        self.weight = torch.nn.Parameter(torch.empty(num_experts, hidden, device=device,
                                                     dtype=dtype))
        torch.nn.init.normal_(self.weight, std=hidden**-0.5)
        if score_bias:
            self.register_buffer("bias", torch.zeros(num_experts, device=device))
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> Routing:
        """``x [T, H]`` -> ``Routing`` (fp32 probs and scores, bool map). No host sync."""
        if x.dim() != 2:
            raise ValueError(f"TopKRouter: x must be [T, H] (flatten the leading dims), got "
                             f"{tuple(x.shape)}")
        logits = F.linear(x.float(), self.weight.float())  # [T, E] fp32
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        sel = scores.detach() if self.bias is None else scores.detach() + self.bias
        if self.num_groups > 1:
            t, e, g = sel.shape[0], self.num_experts, self.num_groups
            grouped = sel.view(t, g, e // g)
            rating = grouped.topk(min(2, e // g), dim=-1).values.sum(-1)  # [T, G]
            keep = torch.zeros_like(rating, dtype=torch.bool).scatter_(
                1, rating.topk(self.topk_groups, dim=-1).indices, True)
            sel = grouped.masked_fill(~keep[..., None], float("-inf")).view(t, e)
        ids = sel.topk(self.top_k, dim=-1).indices  # [T, K]
        w = scores.gather(1, ids)
        if self.normalize:
            w = w / w.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        if self.scale != 1.0:
            w = w * self.scale
        probs = torch.zeros_like(scores).scatter(1, ids, w)
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, ids, True)
        return Routing(probs, routing_map, scores)

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor, rate: float = 1e-3) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing: raise the bias of experts that got
        fewer rows than the mean, lower it for those that got more, by ``rate``. No sync."""
        if self.bias is None:
            raise ValueError("TopKRouter.update_bias: the router has no bias; build it with "
                             "score_bias=True")
        load = tokens_per_expert.float()
        self.bias += rate * torch.sign(load.mean() - load)


def load_balancing_loss(routing: Routing) -> torch.Tensor:
    """Switch-Transformer's auxiliary loss, ``E * sum_e f_e * P_e``: ``f_e`` the share of
    routes to expert ``e`` (pass the map before capacity drops: ``MoERouting.routing()``
    does), ``P_e`` its mean score, the scores normalized per token (softmax scores already
    are; sigmoid scores are divided by their sum, as DeepSeek-V3's balance loss does). 1.0
    when balanced; fp32 scalar, differentiable through the scores."""
    t, e = routing.scores.shape
    routes = routing.routing_map.sum().clamp_min(1)
    f = routing.routing_map.sum(0).float() / routes
    s = routing.scores
    s = s / s.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    p = s.mean(0) if t else s.sum(0)
    return e * (f * p).sum()
