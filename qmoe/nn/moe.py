"""``qmoe.nn.MoE``: a mixture-of-experts feed-forward layer, FP8 from dispatch through the
expert GEMMs.

Glossary: T tokens, H hidden, F expert FFN width, E experts, L experts on this rank
(E without expert parallelism), K experts per token, C rows kept per expert (capacity),
N rows of the permuted buffer.

One forward:

1. route: ``TopKRouter`` (fp32) gives ``probs [T, E]`` and ``routing_map [T, E]``;
2. capacity (``capacity_factor``): each expert keeps its first C routes in token order,
   ``C = ceil(capacity_factor * T * K / E)``; later routes to it are dropped (their token
   gets nothing from that expert). Without it nothing is dropped;
3. dispatch: ``moe_permute_and_pad_with_probs(x, ..., quantize=recipe)``: each token row
   quantized once and written to its experts' groups, each group padded to
   ``align_size`` rows; with ``process_group``, ``qmoe.distributed.dispatch(...,
   quantize=recipe)`` quantizes in its permute's pass and sends the FP8 rows to the
   experts' ranks;
4. experts: ``grouped_mm`` (gate and up, ``[L, H, 2F]``), ``qmoe.swiglu`` (one pass
   forward, one backward), ``grouped_mm`` (down, ``[L, F, H]``). Where ``grouped_mm`` has
   an FP8 GEMM for the recipe (``PerTensor`` or ``RowWise`` e4m3 on Hopper,
   ``fp8_gemm_runs``) the dispatched FP8 rows go into it as they are and the SwiGLU
   output is quantized with the recipe for the down GEMM (in the SwiGLU's pass for the
   block recipes); other
   recipes (``Blockwise``, ``MXFP8``) move FP8 rows (half the bytes of bf16 over the wire)
   and dequantize them for a bf16 GEMM;
5. merge: ``moe_unpermute`` weighted by ``probs`` (fp32 accumulation), or
   ``qmoe.distributed.combine``.

Host syncs: none on one rank when ``static_shapes=True`` (the default): the buffer has a
bound of rows known from T (``T*K + min(E, T*K)*(align_size-1)``, rounded to the
alignment; with a capacity, ``E * round_up(min(C, T), align_size)`` when smaller), so the
layer captures in a CUDA graph and compiles with ``fullgraph=True`` and a dynamic T.
``static_shapes=False`` sizes the buffer exactly with one host sync. With
``process_group`` a capacity keeps it sync-free (every rank pair sends ``L*C`` rows);
without one, dispatch reads the split sizes once.
"""

from __future__ import annotations

from fractions import Fraction
from typing import NamedTuple

import torch
import torch.utils.checkpoint

from qmoe.distributed import combine, dispatch
from qmoe.nn.router import Routing, TopKRouter
from qmoe.ops import (
    expert_offsets,
    grouped_mm,
    moe_permute_and_pad_with_probs,
    moe_unpermute,
    swiglu,
    tokens_per_expert,
)
from qmoe.ops.grouped_mm import ExpertWeightsFP8, fp8_gemm_runs, quantize_expert_weights
from qmoe.tensors import MXFP8, Blockwise, PerTensor, RowWise

__all__ = ["MoE", "MoERouting"]

_RECIPES = (PerTensor, RowWise, Blockwise, MXFP8)


class MoERouting(NamedTuple):
    """What ``MoE.forward`` returns beside its output, for auxiliary losses and balancing."""

    probs: torch.Tensor  # [T, E] fp32 router weights of the kept routes, 0 elsewhere
    routing_map: torch.Tensor  # [T, E] bool, the routes kept (after capacity drops)
    scores: torch.Tensor  # [T, E] fp32 softmax / sigmoid scores
    tokens_per_expert: torch.Tensor  # [E] int32 routes kept per expert (this rank's tokens)
    chosen_map: torch.Tensor  # [T, E] bool, the router's choice (before capacity drops)

    def routing(self) -> Routing:
        """The router's choice as ``TopKRouter`` returns it (the map before capacity drops,
        so that ``load_balancing_loss`` sees the overload that capacity hides)."""
        return Routing(self.probs, self.chosen_map, self.scores)


def _ceil_frac(a, num: int, den: int):
    """``ceil(a * num / den)`` in integer math (a SymInt ``a`` stays symbolic, no guard)."""
    return -(-(a * num) // den)


def _round_up(a, m: int):
    return (a + m - 1) // m * m


class MoE(torch.nn.Module):
    """A top-k MoE layer with SwiGLU experts: ``out, routing = moe(x)``.

    Args:
        hidden: H. ffn: F, each expert's inner width. num_experts: E (all ranks').
        top_k: K.
        recipe: ``None`` (bf16), or ``qmoe.RowWise()``, ``qmoe.PerTensor()``,
            ``qmoe.Blockwise()``, ``qmoe.MXFP8()``: how the dispatched rows and the down
            GEMM's input are quantized (module doc: which recipes run FP8 GEMMs).
        score, normalize, scale, num_groups, topk_groups, score_bias: the router's
            (``TopKRouter``; ``score="sigmoid", score_bias=True, num_groups=8,
            topk_groups=4`` is DeepSeek-V3's).
        capacity_factor: ``None`` (dropless) or a positive number: each expert keeps at
            most ``ceil(capacity_factor * T * K / E)`` routes, the earliest tokens first.
        static_shapes: size the buffer from T (no host sync, default) or exactly (one
            sync; eager only).
        align_size: rows per group are padded to a multiple of it (default 16 with a
            recipe, the FP8 grouped GEMM's alignment; 1 without).
        process_group: expert parallelism: E must be a multiple of the group's size W;
            this rank holds experts ``[rank*L, (rank+1)*L)``, L = E / W. The router is
            replicated (reduce its gradient as for any replicated parameter). With a
            ``capacity_factor`` every rank must pass the same T (C comes from T, and
            each rank pair exchanges ``L*C`` rows); dropless, T may differ.
        recompute: checkpoint the experts (dispatch to merge): their activations are
            recomputed in backward; the router runs once.
        param_dtype: the parameters' dtype (fp32 master weights by default); the GEMMs run
            in bf16 (``compute_dtype``).

    ``forward(x [..., H])`` returns ``(out [..., H] in x's dtype, MoERouting)``.
    """

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int, recipe=None, *,
                 score: str = "softmax", normalize: bool | None = None, scale: float = 1.0,
                 num_groups: int = 1, topk_groups: int = 1, score_bias: bool = False,
                 capacity_factor: float | None = None, static_shapes: bool = True,
                 align_size: int | None = None, process_group=None, recompute: bool = False,
                 device=None, param_dtype: torch.dtype = torch.float32,
                 compute_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if recipe is not None and not isinstance(recipe, _RECIPES):
            raise TypeError(f"MoE: recipe must be None (bf16) or one of qmoe.RowWise(), "
                            f"PerTensor(), Blockwise(), MXFP8(); got {recipe!r}")
        if capacity_factor is not None and not 0 < capacity_factor < float("inf"):
            raise ValueError(f"MoE: capacity_factor must be positive and finite (or None: "
                             f"dropless), got {capacity_factor!r}")
        if compute_dtype != torch.bfloat16 and not (
                compute_dtype == torch.float32 and torch.device(device or "cpu").type == "cpu"):
            raise TypeError(f"MoE: compute_dtype must be torch.bfloat16 (torch.float32 on the "
                            f"CPU), got {compute_dtype}")
        if hidden % 8 or ffn % 8:
            raise ValueError(f"MoE: hidden ({hidden}) and ffn ({ffn}) must be multiples of 8 "
                             "(grouped GEMMs read 16-byte rows)")
        if align_size is None:
            align_size = 1 if recipe is None else 16
        if not isinstance(align_size, int) or align_size < 1:
            raise ValueError(f"MoE: align_size must be a positive int, got {align_size!r}")
        world = 1
        if process_group is not None:
            import torch.distributed as dist

            world = dist.get_world_size(process_group)
        if num_experts % world:
            raise ValueError(f"MoE: num_experts ({num_experts}) must be a multiple of the "
                             f"process group's size ({world})")
        self.hidden, self.ffn, self.num_experts, self.top_k = hidden, ffn, num_experts, top_k
        self.recipe, self.align_size, self.recompute = recipe, align_size, recompute
        # C = ceil(T * K * capacity / E) as the integer ratio (num, den): no float, no
        # guard on a symbolic T
        self.capacity = None
        if capacity_factor is not None:
            r = Fraction(capacity_factor) / num_experts  # exact: a float is a fraction
            self.capacity = (r.numerator, r.denominator)
        self.capacity_factor = capacity_factor
        self.static_shapes, self.process_group = static_shapes, process_group
        self.num_local_experts = num_experts // world
        self.compute_dtype = compute_dtype
        self.router = TopKRouter(hidden, num_experts, top_k, score=score,
                                 normalize=normalize, scale=scale, num_groups=num_groups,
                                 topk_groups=topk_groups, score_bias=score_bias,
                                 device=device, dtype=param_dtype)
        loc = self.num_local_experts
        self.w_gate_up = torch.nn.Parameter(
            torch.randn(loc, hidden, 2 * ffn, device=device, dtype=param_dtype) * hidden**-0.5)
        self.w_down = torch.nn.Parameter(
            torch.randn(loc, ffn, hidden, device=device, dtype=param_dtype) * ffn**-0.5)

    def extra_repr(self) -> str:
        cap = ("dropless" if self.capacity is None
               else f"capacity_factor={self.capacity_factor}")
        return (f"hidden={self.hidden}, ffn={self.ffn}, num_experts={self.num_experts}, "
                f"top_k={self.top_k}, recipe={self.recipe}, {cap}, "
                f"local_experts={self.num_local_experts}")

    # ------------------------------------------------------------------ pieces
    def _capacity_rows(self, t):
        """C, the routes each expert keeps (None: dropless)."""
        if self.capacity is None:
            return None
        return _ceil_frac(t * self.top_k, *self.capacity)

    @torch.no_grad()
    def quantize_weights(self) -> tuple[ExpertWeightsFP8, ExpertWeightsFP8]:
        """The expert weights as the FP8 GEMMs take them, ``(gate_up, down)``
        (``qmoe.quantize_expert_weights`` of their bf16 values): pass them to ``forward``
        to skip the per-call weight quantization, e.g. once per optimizer step under
        gradient accumulation. Stale after the weights change."""
        dt = self.compute_dtype
        return (quantize_expert_weights(self.w_gate_up.to(dt)),
                quantize_expert_weights(self.w_down.to(dt)))

    def _expert_ffn(self, rows, offs, wq):
        """SwiGLU experts on grouped rows ``[N, H]`` (bf16 or FP8) -> ``[N, H]`` bf16."""
        dt = self.compute_dtype
        wq_gu, wq_d = (None, None) if wq is None else wq
        h = grouped_mm(rows, self.w_gate_up.to(dt), offs, weight_fp8=wq_gu)  # [N, 2F]
        # where the down GEMM runs FP8, its input quantized with the recipe in the SwiGLU's
        # pass; [N, F]
        fp8 = self.recipe is not None and fp8_gemm_runs(self.recipe, h.device, self.ffn,
                                                        self.hidden)
        act = swiglu(h, quantize=self.recipe if fp8 else None)
        return grouped_mm(act, self.w_down.to(dt), offs, weight_fp8=wq_d)  # [N, H]

    def _experts(self, x, probs, routing_map, wq=None):
        """``x [T, H]`` through dispatch, experts and merge -> ``[T, H]``."""
        if self.process_group is not None:
            return self._experts_ep(x, probs, routing_map, wq)
        t, e, a = x.shape[0], self.num_experts, self.align_size
        n = None  # static_shapes=False: the exact rows, one host sync
        if self.static_shapes:
            # at most min(E, T*K) groups hold routes, each padded by at most a - 1 rows
            n = _round_up(t * self.top_k + torch.sym_min(e, t * self.top_k) * (a - 1), a)
            if self.capacity is not None:
                c = torch.sym_min(self._capacity_rows(t), t)  # an expert has <= T routes
                n = torch.sym_min(n, e * _round_up(c, a))
        rows, _, rid, _, _ = moe_permute_and_pad_with_probs(
            x, probs, routing_map, None, a, num_out_tokens=n, quantize=self.recipe)
        offs = expert_offsets(tokens_per_expert(routing_map, n, align_size=a))
        return moe_unpermute(self._expert_ffn(rows, offs, wq), rid, probs)

    def _experts_ep(self, x, probs, routing_map, wq):
        c = self._capacity_rows(x.shape[0])
        cap = None if c is None else self.num_local_experts * c
        rows, tpe, handle = dispatch(x, probs, routing_map, self.num_local_experts,
                                     self.process_group, capacity=cap, quantize=self.recipe)
        y = self._expert_ffn(rows, expert_offsets(tpe), wq)
        return combine(y, handle)

    # ----------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, *, weights_fp8=None) -> tuple[torch.Tensor, MoERouting]:
        """``x [..., H]`` (bf16, or fp32 / fp16: cast to bf16 for the experts) ->
        ``(out [..., H] in x's dtype, MoERouting)``. ``weights_fp8``: optional
        ``self.quantize_weights()``, read by the FP8 GEMMs instead of quantizing the
        weights in the call (the weight gradients still reach the parameters). No host
        sync (class doc)."""
        if x.shape[-1] != self.hidden:
            raise ValueError(f"MoE: x must be [..., H={self.hidden}], got {tuple(x.shape)}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.hidden)
        r = self.router(x2)
        routing_map, probs = r.routing_map, r.probs
        if weights_fp8 is not None and not (isinstance(weights_fp8, tuple)
                                            and len(weights_fp8) == 2):
            raise TypeError("MoE: weights_fp8 must be the (gate_up, down) pair "
                            "layer.quantize_weights() returns")
        c = self._capacity_rows(x2.shape[0])
        if c is not None:  # each expert keeps its first C routes (token order)
            routing_map = routing_map & (routing_map.int().cumsum(0) <= c)
            probs = probs * routing_map
        xc = x2.to(self.compute_dtype)
        if self.recompute:
            out = torch.utils.checkpoint.checkpoint(self._experts, xc, probs, routing_map,
                                                    weights_fp8, use_reentrant=False)
        else:
            out = self._experts(xc, probs, routing_map, weights_fp8)
        tpe = routing_map.sum(0, dtype=torch.int32)
        return (out.to(x.dtype).reshape(*lead, self.hidden),
                MoERouting(probs, routing_map, r.scores, tpe, r.routing_map))
