"""Train an HF transformers causal LM (built from a config: nothing is downloaded) with fsdp_graph.

One process (CPU or one GPU); --smoke: a tiny model, a few steps, seconds on CPU:
    python examples/train_hf.py --smoke
    python examples/train_hf.py --arch gpt2 --steps 50
Sharded over several processes with torchrun (gloo on CPU, NCCL on GPUs):
    launch/run.sh --nproc-per-node 2 examples/train_hf.py --smoke
    launch/run.sh examples/train_hf.py --size small --dtype bf16 --steps 200
Under `accelerate launch --multi_gpu` (it starts the processes through torchrun, on a machine
without GPUs too: there `--cpu` would start one process, and `--multi_gpu --cpu` is refused);
--accelerate also lets an `accelerate.Accelerator` prepare the optimizer, data loader and scheduler:
    accelerate launch --multi_gpu --num_processes 2 examples/train_hf.py --smoke --accelerate
CUDA graphs (GPU): every decoder layer, or the whole step (collectives and AdamW included):
    launch/run.sh examples/train_hf.py --size small --dtype bf16 --graph layer
    launch/run.sh examples/train_hf.py --size small --dtype bf16 --graph full_iteration --grad-accum 2
    accelerate launch --multi_gpu --num_processes 2 examples/train_hf.py --size small --dtype bf16 \\
        --graph full_iteration --accelerate

Every rank builds the same model from the same seed; `fsdp_graph.hf.shard_model` makes each decoder
layer a unit, then the root. The data is synthetic (examples/hf_models.py's hf_batch turned into a
random walk a model can learn); step s uses a global batch of world size x grad-accum x batch rows,
the same on every rank, of which each rank takes its own, so any launch of the same global batch
trains on the same rows (tests/test_example_hf.py compares them).

What --accelerate supports (accelerate 1.15): `Accelerator.prepare` of the optimizer, the
DataLoader and the LR scheduler, not of the model. The model is already sharded (its parameters
are DTensors), and prepare(model) would wrap it in DistributedDataParallel: on GPUs it refuses
("Your model contains `DTensor` parameters, which is incompatible with DDP"), on CPU processes
DDP's first broadcast fails on the DTensors, and with one process it only moves the model (and,
under accelerate's --mixed_precision, wraps its forward in autocast). So: --dtype bf16
(fsdp_graph's MixedPrecisionPolicy) instead of accelerate's --mixed_precision, and
make_train_step's gradient accumulation and clipping instead of accelerator.accumulate /
backward / clip_grad_norm_ (see the comments in main).
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import os
import sys
import time

# Make `import hf_models` and `import fsdp_graph` work without installing anything (see train_gpt.py).
_EXAMPLES_DIR = os.path.dirname(os.path.abspath(__file__))
if _EXAMPLES_DIR not in sys.path:
    sys.path.insert(0, _EXAMPLES_DIR)
try:
    import fsdp_graph
except ImportError:
    sys.path.insert(0, os.path.dirname(_EXAMPLES_DIR))
    import fsdp_graph

import torch
import torch.distributed
from hf_models import ARCHS, SIZES, build_hf, hf_batch
from mfu import mfu
from tqdm import tqdm
from train_gpt import mean_over_ranks, synchronize  # the GPT example's helpers

import fsdp_graph.hf

DEFAULT_LR = {"tiny": 3e-3, "small": 1e-3, "medium": 3e-4}  # peak rates that train each size stably
SMOKE = {"size": "tiny", "seq": 32, "batch": 4, "steps": 20, "warmup_steps": 2, "log_every": 5}
TIMING_SKIP = 5  # steps left out of the mean step time: allocations, warm-up, a whole-step graph's capture


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=ARCHS, default="llama")
    p.add_argument("--size", choices=sorted(SIZES), default=None, help="default: small on CUDA, tiny on CPU")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 512)")
    p.add_argument("--batch", type=int, default=None, help="micro-batch per rank, in sequences (default 8)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 100)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: per size)")
    p.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up, then cosine to 10%% (default 10)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None,
                   help="compute dtype; bf16: bf16 parameters, fp32 gradient reduction (default: bf16 on CUDA)")
    p.add_argument("--graph", choices=["none", "layer", "full_iteration"], default="none",
                   help="CUDA graphs (GPU only): layer = every decoder layer, full_iteration = the whole step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    p.add_argument("--seed", type=int, default=0, help="model initialisation (the data depends on the step only)")
    p.add_argument("--log-every", type=int, default=None, help="progress postfix every N steps (default 10)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a collective waits for the other ranks before the job fails with an error")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--accelerate", action="store_true",
                   help="let accelerate.Accelerator prepare the optimizer, data loader and scheduler")
    p.add_argument("--smoke", action="store_true", help=f"a quick check: {SMOKE} unless given")
    args = p.parse_args()
    if args.grad_accum < 1 or (args.steps is not None and args.steps < 1):
        p.error("--steps and --grad-accum must be >= 1")
    defaults = {"size": "small" if torch.cuda.is_available() else "tiny", "seq": 512, "batch": 8, "steps": 100,
                "warmup_steps": 10, "log_every": 10}
    for key, value in {**defaults, **(SMOKE if args.smoke else {})}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.lr is None:
        args.lr = DEFAULT_LR[args.size]
    return args


class WalkTokens(torch.utils.data.Dataset):
    """Row i of the token stream: step s owns rows [s * rows_per_step, (s + 1) * rows_per_step).

    Each row is a walk over the vocabulary, every token the previous one plus 1 to 4, the moves taken
    from hf_batch (seeded by the step): learnable, so the loss visibly falls."""

    def __init__(self, vocab: int, seq: int, rows_per_step: int, steps: int) -> None:
        self.vocab, self.seq, self.rows_per_step, self.steps = vocab, seq, rows_per_step, steps

    def __len__(self) -> int:
        return self.steps * self.rows_per_step

    @functools.lru_cache(maxsize=2)
    def step_rows(self, step: int) -> torch.Tensor:
        raw = hf_batch(self.vocab, self.rows_per_step, self.seq, step)
        moves = torch.cat([raw[:, :1], 1 + raw[:, 1:] % 4], dim=1)  # a random start, then the moves
        return moves.cumsum(dim=1) % self.vocab

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.step_rows(i // self.rows_per_step)[i % self.rows_per_step]


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up to args.lr, then cosine decay to 10% of it at the last step."""
    warmup = min(args.warmup_steps, args.steps)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def main() -> None:
    args = parse_args()
    dist = fsdp_graph.init_distributed(timeout=args.timeout)  # torchrun, accelerate launch or plain python
    device, rank, world = dist.device, dist.rank, dist.world_size
    cuda = device.type == "cuda"
    dtype = args.dtype or ("bf16" if cuda else "fp32")

    accelerator = None
    if args.accelerate:
        import accelerate

        # After init_distributed, so the group it made (with --timeout) is the one accelerate uses.
        # cpu=True on CPU: otherwise accelerate, seeing LOCAL_RANK without a GPU, counts one process.
        # step_scheduler_with_optimizer=False: a scheduler prepared with it True steps num_processes
        # times per call (accelerate assumes a schedule written for one process's batches).
        accelerator = accelerate.Accelerator(cpu=not cuda, step_scheduler_with_optimizer=False)
        if accelerator.num_processes != world:
            raise SystemExit(f"accelerate sees {accelerator.num_processes} processes, the launcher started {world}")
        if accelerator.mixed_precision != "no":
            raise SystemExit(f"accelerate's --mixed_precision {accelerator.mixed_precision} would not reach the "
                             "sharded model: use --dtype bf16 (fsdp_graph's MixedPrecisionPolicy) instead")

    # Same seed on every rank: every replica starts from the same weights (verify=True checks it).
    model = build_hf(args.arch, args.size, seed=args.seed, device=device)
    # Training needs no KV cache, and HF's default (use_cache=True) makes a new cache object every
    # forward, which per-layer graphs refuse (a non-tensor argument that changes between calls).
    model.config.use_cache = False
    vocab = model.config.vocab_size
    n_params = sum(p.numel() for p in model.parameters())
    layer_class = type(fsdp_graph.hf.decoder_layers(model)[0])

    mp_policy = fsdp_graph.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if dtype == "bf16" else None,
        reduce_dtype=torch.float32 if dtype == "bf16" else None,
    )
    # Every decoder layer a unit, then the root; also takes HF's capture path (eager = graphed kernels).
    fsdp_graph.hf.shard_model(model, mp_policy=mp_policy, verify=True)

    # The sharded fp32 masters (shapes are the original ones): weight decay on matrices only.
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # A whole-step graph needs a capturable optimizer; on GPU fused, its rate in a device tensor.
    optimizer = torch.optim.AdamW(
        groups, lr=torch.tensor(args.lr, device=device) if cuda else args.lr, betas=(0.9, 0.95),
        fused=cuda or None, capturable=args.graph == "full_iteration",
    )
    # The schedule as a multiplier of the peak rate (torch's schedulers fill tensor rates in place).
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, args) / args.lr)

    # Data: step s's rows are batch s * world + r of this loader for rank r (rows_per_rank each).
    rows_per_rank = args.grad_accum * args.batch
    dataset = WalkTokens(vocab, args.seq, rows_per_step=rows_per_rank * world, steps=args.steps)
    if accelerator is not None:
        # accelerate shards a prepared loader by batches: process r gets batches r, r + world, ...
        # (and moves them to its device). The prepared optimizer steps and zeroes at every call,
        # since nothing here calls accelerator.accumulate (sync_gradients stays True).
        loader = torch.utils.data.DataLoader(dataset, batch_size=rows_per_rank)
        optimizer, loader, scheduler = accelerator.prepare(optimizer, loader, scheduler)
    else:
        mine = [(s * world + rank) * rows_per_rank + j for s in range(args.steps) for j in range(rows_per_rank)]
        loader = torch.utils.data.DataLoader(torch.utils.data.Subset(dataset, mine), batch_size=rows_per_rank)

    def step_batch(rows: torch.Tensor) -> tuple[torch.Tensor]:
        """This rank's rows of one step, with --grad-accum K stacked as [K, batch, seq]."""
        rows = rows.to(device, non_blocking=True)
        return (rows.view(args.grad_accum, args.batch, args.seq) if args.grad_accum > 1 else rows,)

    batches = (step_batch(rows) for rows in loader)
    first_batch = next(batches)

    # The step: forward, backward, clipping, AdamW (eager, every decoder layer a CUDA graph, or the
    # whole step one graph). Gradient accumulation is make_train_step's (K micro-batches, no-sync
    # backwards, one reduce-scatter of the sum; inside the graph for full_iteration), not
    # accelerator.accumulate's: that toggles DDP's no_sync, which does not exist here, and the
    # backward is the step's own (not accelerator.backward: no loss scaling is needed for bf16).
    graph = fsdp_graph.GraphConfig(strategy=args.graph, modules=layer_class if args.graph == "layer" else None)
    train_step = fsdp_graph.make_train_step(
        lambda ids: model(input_ids=ids, labels=ids).loss, model, optimizer, config=graph,
        example_batch=first_batch, grad_accum_steps=args.grad_accum,
        max_grad_norm=args.max_grad_norm if args.max_grad_norm > 0 else None,
    )
    gc.collect()
    gc.freeze()  # long-lived set-up objects out of the collector's sight (see train_gpt.py)

    tokens_per_step = rows_per_rank * args.seq * world  # global
    if rank == 0:
        launcher = (f"accelerate {accelerator.distributed_type.value} x{accelerator.num_processes}"
                    if accelerator is not None else "no accelerate")
        print(f"{args.arch} {args.size} ({n_params / 1e6:.2f}M params) | world size {world} | {launcher} | "
              f"dtype {dtype} | graph {args.graph} | grad accum {args.grad_accum} | {tokens_per_step} tokens/step | "
              f"device {device.type}", flush=True)

    bar = tqdm(total=args.steps, disable=rank != 0 or args.no_progress, desc="train", unit="step")
    model.train()
    skip = min(TIMING_SKIP, args.steps - 1)
    window_loss, window_steps, window_start = torch.zeros((), device=device), 0, time.perf_counter()
    first_loss = timed_start = None
    for step in range(args.steps):
        if step == skip:
            synchronize(device)
            timed_start = time.perf_counter()
        loss = train_step(*(first_batch if step == 0 else next(batches)))
        scheduler.step()  # the next step's rate (filled in place: a whole-step graph reads the tensor)
        if step == 0:
            first_loss = mean_over_ranks(loss)
        window_loss += loss
        window_steps += 1
        bar.update(1)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            mean_loss = mean_over_ranks(window_loss / window_steps)  # also waits for the device
            now = time.perf_counter()
            tok_s = tokens_per_step * window_steps / (now - window_start)
            postfix = {"loss": f"{mean_loss:.4f}", "tok/s": f"{tok_s:,.0f}"}
            utilisation = mfu(n_params, tok_s, world, device)  # 6 N flops per token over the bf16 peak
            if utilisation is not None:
                postfix["mfu"] = f"{utilisation:.1%}"
            bar.set_postfix(postfix)
            window_loss.zero_()
            window_steps, window_start = 0, now

    synchronize(device)
    timed = args.steps - skip
    step_ms = 1000 * (time.perf_counter() - timed_start) / timed
    final_loss = mean_over_ranks(loss)
    bar.close()
    if rank == 0:
        print(f"final loss {final_loss:.6f} | first loss {first_loss:.6f} | {step_ms:.2f} ms/step "
              f"(mean of the last {timed} steps) | {tokens_per_step * 1000 / step_ms:,.0f} tokens/s | "
              f"world size {world} | {args.steps} steps", flush=True)


if __name__ == "__main__":
    main()  # an exception exits non-zero; torchrun then stops the other ranks
    fsdp_graph.shutdown()  # optional: init_distributed registers it at exit
