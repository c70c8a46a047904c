"""Train a Hugging Face Llama (random weights from a config, no download) with micscompile.

    torchrun --standalone --nproc-per-node 4 examples/hf_llama.py --partition-size 2 --check
    torchrun --standalone --nproc-per-node 4 examples/hf_llama.py --partition-size 2 --stages 2 --check

Any ``transformers`` causal LM works the same way: build it (``use_cache=False``), pass it to
``mc.compile`` with a loss that reads ``output.logits``. ``micscompile.zoo.hf_models`` lists what is
supported. With --check, rank 0 also trains the model eagerly in one process on the whole global
batch and compares losses and parameters.
"""

from __future__ import annotations

import argparse
import copy
import datetime

import torch
import torch.distributed as dist
import transformers

import micscompile as mc
from micscompile.cli.parity import TOLERANCE, state_error, train_reference
from micscompile.zoo.hf_models import lm_loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--partition-size", type=int, default=2, help="p (t per stage with --stages > 1)")
    ap.add_argument("--stages", type=int, default=1, help="pipeline stages S")
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4, help="samples per data-parallel chain per step")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--check", action="store_true", help="compare with single-process eager PyTorch")
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq,
                                      use_cache=False, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    plan = mc.Plan(partition_size=args.partition_size, pipeline_stages=args.stages, micro_batches=args.micro_batches)
    chains = world // args.stages
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 256, (args.batch * chains, args.seq), generator=gen),) * 2 for _ in range(args.steps)]
    batches = [(x, torch.roll(x, -1, dims=1)) for x, _ in batches]  # next-token targets
    p = args.partition_size
    chain = rank // (args.stages * p) * p + rank % p  # the ranks of one pipeline share a batch slice
    local = [tuple(t[chain * args.batch: (chain + 1) * args.batch] for t in b) for b in batches]

    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    reference = train_reference(copy.deepcopy(model), lm_loss, sgd, batches) if args.check and rank == 0 else None
    step = mc.compile(model, plan, loss_fn=lm_loss, optimizer=sgd, example_inputs=local[0])
    if rank == 0:
        print(f"Llama {sum(q.numel() for q in model.parameters()) / 1e6:.2f}M parameters on {world} gloo ranks, "
              f"plan {step.program.plan}")
    for i, batch in enumerate(local):
        loss = float(step(*batch))
        if rank == 0:
            ref = f"   eager {reference[0][i]:.6f}" if reference else ""
            print(f"step {i}: loss {loss:.6f}{ref}")
    state = step.full_state_dict()  # collective: every rank calls it
    if reference:
        err, name = state_error(state, reference[1])
        print(f"parameters vs eager: max rel err {err:.2e} ({name}): {'OK' if err <= TOLERANCE else 'MISMATCH'}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
