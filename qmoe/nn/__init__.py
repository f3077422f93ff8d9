"""Modules built on qmoe's ops: the MoE layer and its router."""

from qmoe.nn.moe import MoE, MoERouting
from qmoe.nn.router import Routing, TopKRouter, load_balancing_loss

__all__ = ["MoE", "MoERouting", "TopKRouter", "Routing", "load_balancing_loss"]
