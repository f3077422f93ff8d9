"""Expert parallelism with qmoe.distributed: a runnable example.

    torchrun --nproc-per-node 2 examples/ep_dispatch.py            # CPU, Gloo
    torchrun --nproc-per-node 2 examples/ep_dispatch.py --fp8      # FP8 (blockwise) payload

Each rank routes its tokens to E = world * 2 experts, dispatches them (the rows of
experts it does not own travel to their rank), runs its two local experts, combines the
results back with the router probs, and backpropagates.
"""

import argparse
import datetime

import torch
import torch.distributed as dist

import qmoe
from qmoe.distributed import TokenDispatcher


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    a = p.parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = f"cuda:{rank}" if backend == "nccl" else "cpu"
    local, k = 2, 2
    e = world * local
    torch.manual_seed(rank)
    x = torch.randn(a.tokens, a.hidden, device=dev, requires_grad=True)
    logits = torch.randn(a.tokens, e, device=dev)
    top = logits.topk(k, dim=1)
    mask = torch.zeros(a.tokens, e, dtype=torch.bool, device=dev).scatter_(1, top.indices, True)
    probs = torch.zeros(a.tokens, e, device=dev).scatter(1, top.indices, top.values.softmax(1))
    weights = torch.randn(local, a.hidden, a.hidden, device=dev) / a.hidden**0.5  # my experts

    inp = qmoe.quantize(x, qmoe.Blockwise()) if a.fp8 else x
    dispatcher = TokenDispatcher(num_local_experts=local)
    expert_in, tokens_per_expert = dispatcher.dispatch(inp, probs, mask)
    rows = expert_in.dequantize() if a.fp8 else expert_in
    outs, start = [], 0
    for le, n in enumerate(tokens_per_expert.tolist()):
        outs.append(rows[start : start + n] @ weights[le])
        start += n
    y = dispatcher.combine(torch.cat(outs))
    y.square().mean().backward()
    print(f"rank {rank}/{world}: sent {int(mask.sum())} rows as "
          f"{type(expert_in).__name__}, received {expert_in.shape[0]} rows for experts "
          f"{list(range(rank * local, (rank + 1) * local))} ({tokens_per_expert.tolist()}), "
          f"y {tuple(y.shape)}, |dx| = {x.grad.norm():.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
