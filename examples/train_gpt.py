"""Train a small GPT with fsdp_graph: a plain, linear script (nanoGPT / torchtitan style).

Single process (CPU or one GPU):
    python examples/train_gpt.py
Sharded over several processes (gloo on CPU, NCCL on GPUs):
    launch/run.sh --nproc-per-node 2 examples/train_gpt.py --steps 50
Bigger model, synthetic tokens, bf16 compute:
    launch/run.sh examples/train_gpt.py --config small --dtype bf16 --steps 100
CUDA graphs (GPU): each block, or the whole step (collectives and optimizer included):
    launch/run.sh examples/train_gpt.py --config small --graph layer
    launch/run.sh examples/train_gpt.py --config small --graph full_iteration --grad-accum 2
Checkpoints every 50 steps, and after a crash (or under torchrun --max-restarts) resume exactly:
    launch/run.sh --max-restarts 3 examples/train_gpt.py --checkpoint-dir ckpt --checkpoint-every 50 --resume

Every rank builds the same model from the same seed, shards it (each block, then the root),
and trains on its own micro-batches; gradients are averaged by the reduce-scatter.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time

# Make `from gpt import ...` and `import fsdp_graph` work without installing anything:
# this file's folder (examples/) and, if fsdp_graph is not importable, the repo root.
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

from gpt import CONFIGS, GPT, GPTConfig

# A tiny built-in corpus (public domain) for `--data text`: byte-level tokens, vocab 256.
CORPUS = """\
Four score and seven years ago our fathers brought forth on this continent, a new nation, \
conceived in Liberty, and dedicated to the proposition that all men are created equal. \
Now we are engaged in a great civil war, testing whether that nation, or any nation so \
conceived and so dedicated, can long endure. We are met on a great battle-field of that \
war. We have come to dedicate a portion of that field, as a final resting place for those \
who here gave their lives that that nation might live. It is altogether fitting and proper \
that we should do this.

It was the best of times, it was the worst of times, it was the age of wisdom, it was the \
age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the \
season of Light, it was the season of Darkness, it was the spring of hope, it was the winter \
of despair, we had everything before us, we had nothing before us, we were all going direct \
to Heaven, we were all going direct the other way.

It is a truth universally acknowledged, that a single man in possession of a good fortune, \
must be in want of a wife. However little known the feelings or views of such a man may be \
on his first entering a neighbourhood, this truth is so well fixed in the minds of the \
surrounding families, that he is considered the rightful property of some one or other of \
their daughters.

Call me Ishmael. Some years ago, never mind how long precisely, having little or no money \
in my purse, and nothing particular to interest me on shore, I thought I would sail about a \
little and see the watery part of the world. It is a way I have of driving off the spleen, \
and regulating the circulation. Whenever I find myself growing grim about the mouth; \
whenever it is a damp, drizzly November in my soul; then, I account it high time to get to \
sea as soon as I can.
"""


# Peak learning rates that train each preset stably (bigger models want smaller steps).
DEFAULT_LR = {"tiny": 3e-3, "small": 1e-3, "medium": 3e-4}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny", choices=sorted(CONFIGS), help="model preset (examples/gpt.py)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="micro-batch size per rank (sequences)")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate, linear warmup then cosine decay to 10%% "
                        "(default: per config, see DEFAULT_LR)")
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm (0 disables clipping)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None,
                   help="compute dtype; bf16 = bf16 params, fp32 gradient reduction "
                        "(default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--graph", choices=["none", "layer", "full_iteration"], default="none",
                   help="CUDA graphs (GPU only), fsdp_graph.GraphConfig(strategy=...): layer = every transformer "
                        "block as a graph; full_iteration = the whole step, optimizer included, as one graph")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--data", choices=["synthetic", "text"], default=None,
                   help="text: built-in corpus, byte tokens (needs vocab >= 256); synthetic: uniform random "
                        "tokens, nothing to learn, for throughput (default: text for tiny, synthetic otherwise)")
    p.add_argument("--log-every", type=int, default=10, help="progress update every N steps")
    p.add_argument("--checkpoint-dir", default=None, help="save checkpoints here (fsdp_graph.Checkpointer)")
    p.add_argument("--checkpoint-every", type=int, default=100, help="save every N steps (and after the last)")
    p.add_argument("--keep-checkpoints", type=int, default=3, help="keep the newest N checkpoints")
    p.add_argument("--resume", action="store_true",
                   help="start from the newest complete checkpoint in --checkpoint-dir, if there is one")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a collective waits for the other ranks before the job fails with an error")
    args = p.parse_args()
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir (where to look for checkpoints)")
    if args.checkpoint_every < 1:
        p.error("--checkpoint-every must be >= 1")
    if args.lr is None:
        args.lr = DEFAULT_LR[args.config]
    return args


class Batches:
    """Each rank draws its own (inputs, targets) micro-batches from a generator seeded with seed + rank.
    Its position is the generator's state (``state_dict``), which checkpoints save per rank."""

    def __init__(self, kind: str, cfg: GPTConfig, batch_size: int, seed: int, device: torch.device) -> None:
        self.kind, self.cfg, self.batch_size, self.device = kind, cfg, batch_size, device
        self.gen = torch.Generator().manual_seed(seed)
        if kind == "text":
            if cfg.vocab_size < 256:
                raise ValueError(f"--data text needs vocab_size >= 256 (byte tokens), got {cfg.vocab_size}")
            self.tokens = torch.tensor(list(CORPUS.encode("utf-8")), dtype=torch.long)
            if len(self.tokens) <= cfg.seq_len + 1:
                raise ValueError(f"built-in corpus ({len(self.tokens)} bytes) too short for seq_len {cfg.seq_len}")

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = self.batch_size, self.cfg.seq_len
        if self.kind == "text":
            starts = torch.randint(0, len(self.tokens) - T - 1, (B,), generator=self.gen)
            windows = torch.stack([self.tokens[s : s + T + 1] for s in starts.tolist()])
        else:
            windows = torch.randint(0, self.cfg.vocab_size, (B, T + 1), generator=self.gen)
        windows = windows.to(self.device, non_blocking=True)
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict:
        return {"generator": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["generator"])


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup to args.lr, then cosine decay to 10% of it at the last step."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


class ProgressBar:
    """A minimal progress bar: redraws one line with '\\r' on a terminal, one line per update otherwise."""

    def __init__(self, total: int, width: int = 30) -> None:
        self.total, self.width = total, width
        self.tty = sys.stdout.isatty()

    def update(self, step: int, text: str) -> None:
        filled = self.width * step // self.total
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {step}/{self.total} | {text}"
        if self.tty:
            sys.stdout.write("\r" + line)
        else:
            sys.stdout.write(line + "\n")
        sys.stdout.flush()

    def close(self) -> None:
        if self.tty:
            sys.stdout.write("\n")
            sys.stdout.flush()


def mean_over_ranks(value: torch.Tensor) -> float:
    """Average a scalar tensor over all ranks (only when a process group exists)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        value = value.clone()
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.SUM)
        value /= torch.distributed.get_world_size()
    return value.item()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    args = parse_args()
    dist = fsdp_graph.init_distributed(timeout=args.timeout)
    device = dist.device
    cfg = CONFIGS[args.config]
    data = args.data or ("text" if args.config == "tiny" else "synthetic")
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    mp_policy = (
        fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if dtype == "bf16"
        else fsdp_graph.MixedPrecision()
    )

    # Same seed on every rank, so all replicas start from the same weights.
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = GPT(cfg)
    n_params = model.num_params()

    # Weight decay on matrices only; decided on the unsharded shapes, applied by name later.
    no_decay = {name for name, p in model.named_parameters()
                if p.dim() < 2 or name.endswith("bias") or "ln" in name or "norm" in name}

    # Shard each block (one sharding unit each), then the root (embeddings, final norm, head),
    # checking first that every rank built the same weights (verify=True: one small collective per unit).
    for block in model.blocks:
        fsdp_graph.fully_shard(block, mp_policy=mp_policy, verify=True)
    fsdp_graph.fully_shard(model, mp_policy=mp_policy, verify=True)

    # The optimizer sees the sharded fp32 master parameters under their original names.
    named = list(model.named_parameters())
    param_groups = [
        {"params": [p for n, p in named if n not in no_decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in named if n in no_decay], "weight_decay": 0.0},
    ]
    # On GPU: fused AdamW, learning rate in a device tensor, capturable (what a whole-step graph needs).
    cuda = device.type == "cuda"
    optimizer = torch.optim.AdamW(
        param_groups, lr=torch.tensor(args.lr, device=device) if cuda else args.lr, betas=(0.9, 0.95),
        fused=cuda or None, capturable=args.graph == "full_iteration",
    )
    # The schedule as a multiplier of the peak rate: torch's schedulers fill tensor rates in place.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, args) / args.lr)

    batches = Batches(data, cfg, args.batch_size, args.seed + dist.rank, device)

    # Resume (before the step is built: a whole-step graph captures the optimizer state it finds).
    checkpoints = (fsdp_graph.Checkpointer(args.checkpoint_dir, keep_last=args.keep_checkpoints)
                   if args.checkpoint_dir else None)
    start = 0
    if args.resume:
        start = checkpoints.load(model, optimizer, scheduler=scheduler, data=batches) or 0
        if dist.is_main:
            print(f"resumed from step {start}" if start else "no checkpoint to resume from: starting at step 0",
                  flush=True)
    tokens_per_step = args.batch_size * cfg.seq_len * dist.world_size * args.grad_accum  # global

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        """One step's batch; with --grad-accum K, K micro-batches stacked on a leading dimension."""
        if args.grad_accum == 1:
            return batches.next()
        micro = [batches.next() for _ in range(args.grad_accum)]
        return torch.stack([x for x, _ in micro]), torch.stack([y for _, y in micro])

    # The step (forward, backward, clipping, optimizer) for the chosen graph strategy: eager,
    # each block a CUDA graph, or the whole step one graph. The config is checked before any work.
    train_step = fsdp_graph.make_train_step(
        lambda inputs, targets: model(inputs, targets)[1], model, optimizer,
        config=fsdp_graph.GraphConfig(strategy=args.graph), example_batch=(first_batch := next_batch()),
        grad_accum_steps=args.grad_accum, max_grad_norm=args.grad_clip if args.grad_clip > 0 else None,
    )

    # Long-lived set-up objects out of the collector's sight: a full Python GC scanning them mid-run
    # costs a host-bound step (layer graphs) several times its median (examples/soak.py measures it).
    gc.collect()
    gc.freeze()

    is_main = dist.is_main
    if is_main:
        print(f"config {args.config} ({n_params / 1e6:.2f}M params) | data {data} | dtype {dtype} | "
              f"device {device.type} | world size {dist.world_size} | "
              f"{tokens_per_step} tokens/step", flush=True)
    bar = ProgressBar(args.steps) if is_main else None

    model.train()
    loss_sum = torch.zeros((), device=device)  # summed on device: no host sync between log points
    loss_count = 0
    first_loss = last_loss = float("nan")
    window_start = run_start = None
    window_steps = 0
    last_tok_s = 0.0
    for step in range(start, args.steps):
        loss = train_step(*(first_batch if step == start else next_batch()))
        scheduler.step()  # the next step's learning rate, filled in place (a graph reads the tensor)
        loss_sum += loss
        loss_count += 1
        if checkpoints is not None and ((step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps):
            checkpoints.save(step + 1, model, optimizer, scheduler=scheduler, data=batches)

        if step == start:
            # The first step warms up (allocations, kernel selection): exclude it from tokens/s.
            first_loss = mean_over_ranks(loss.detach())
            synchronize(device)
            window_start = run_start = time.perf_counter()
            window_steps = 0
            loss_sum.zero_()
            loss_count = 0
            continue
        window_steps += 1

        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            last_loss = mean_over_ranks(loss_sum / loss_count)  # mean over the window and the ranks
            now = time.perf_counter()  # .item() above synchronised with the device
            last_tok_s = tokens_per_step * window_steps / (now - window_start)
            if bar is not None:
                bar.update(step + 1, f"loss {last_loss:.4f} | {last_tok_s:,.0f} tokens/s")
            loss_sum.zero_()
            loss_count = 0
            window_start, window_steps = now, 0

    if bar is not None:
        bar.close()
    timed = args.steps - start - 1  # steps after the first (warm-up) one of this run
    if timed <= 0:
        last_loss = first_loss
    if is_main:
        elapsed = time.perf_counter() - run_start if run_start is not None else 0.0
        tok_s = tokens_per_step * timed / elapsed if timed > 0 and elapsed > 0 else last_tok_s
        ms = 1000 * elapsed / timed if timed > 0 and elapsed > 0 else float("nan")
        print(f"final loss {last_loss:.4f} | {tok_s:.0f} tokens/s | {ms:.1f} ms/step | graph {args.graph} "
              f"| world size {dist.world_size} | first loss {first_loss:.4f} | {args.steps} steps", flush=True)


if __name__ == "__main__":
    main()  # an exception exits non-zero; torchrun then stops the other ranks
    fsdp_graph.shutdown()  # optional: init_distributed registers it at exit
