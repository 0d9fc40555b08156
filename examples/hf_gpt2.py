"""A small Hugging Face GPT-2 learns single-digit sums, in a custom loop on several replicas.

    pip install transformers                           # the one extra: the model is built from a config
    .venv/bin/python examples/hf_gpt2.py                 # 2 logical CPU replicas, 600 steps (~1 min)
    .venv/bin/python examples/hf_gpt2.py --steps 200 --checkpoint-dir runs/gpt2   # run it again to continue
    .venv/bin/python examples/hf_gpt2.py --replicas 1    # the same run on one device, to compare

Nothing is downloaded: `GPT2LMHeadModel(GPT2Config(...))` builds a 2-layer GPT-2 (its output layer tied to
its token embedding, as GPT-2's is), and the text is generated here: lines such as "4+7=11", one
character a token. The loop is the one Hugging Face's scripts write (AdamW, a cosine schedule with warmup,
gradient clipping, `model(input_ids=..., labels=...)` returning the loss), with three changes:

- `strategy.mirror(model)` and `strategy.mirror_optimizer(torch.optim.AdamW, model,
  gradient_reduction="mean", ...)`: each replica trains its own copy on its part of the global batch, and
  the gradients are averaged when backward ends (DDP's rule), so the loss stays the model's own mean and
  clip_grad_norm_ between backward and step clips the averaged gradient, as one device would;
- the step runs in `strategy.run`, and the schedule is attached to the optimizer
  (`optimizer.attach_lr_scheduler`), so a checkpoint carries its place;
- `mr.train.Checkpoint` saves the weights, AdamW's moments, the schedule, the data iterator and the step
  count every --save-every steps; a run started again with the same --checkpoint-dir continues there,
  with the data and dropout masks the uninterrupted run would have had (MirroredStrategy(seed=...) draws
  each replica's dropout from the run's seed), on any number of replicas.
"""
from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time

import torch

import mirrored as mr

try:
    from transformers import GPT2Config, GPT2LMHeadModel, get_cosine_schedule_with_warmup
except ImportError as e:  # (the library does not need it; this example does)
    raise SystemExit(f"examples/hf_gpt2.py needs Hugging Face transformers: pip install transformers ({e})")

VOCAB = "0123456789+=\n"  # one character a token; a line ends with "\n"
NEWLINE = VOCAB.index("\n")
BLOCK = 48  # tokens an example: about five lines


def additions(n: int, seed: int) -> str:
    """n lines "a+b=c" with a and b below 10, from a seeded generator."""
    rng = random.Random(seed)
    return "".join(f"{a}+{b}={a + b}\n" for a, b in ((rng.randrange(10), rng.randrange(10)) for _ in range(n)))


def blocks(text: str) -> torch.Tensor:
    """The text's tokens cut into rows of BLOCK (as Hugging Face's run_clm groups texts); the rest is dropped."""
    ids = torch.tensor([VOCAB.index(c) for c in text])
    return ids[: len(ids) // BLOCK * BLOCK].view(-1, BLOCK)


def complete(module: torch.nn.Module, prompt: str, max_new: int = 4) -> str:
    """Greedy completion of `prompt` up to the end of its line, by one copy of the model."""
    ids = torch.tensor([[VOCAB.index(c) for c in prompt]])
    with torch.no_grad():
        for _ in range(max_new):
            nxt = module(input_ids=ids).logits[0, -1].argmax()
            if nxt.item() == NEWLINE:
                break
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return "".join(VOCAB[i] for i in ids[0].tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2, help="logical CPU replicas (default 2)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--per-replica-batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=30, help="warmup steps of the cosine schedule")
    parser.add_argument("--clip", type=float, default=1.0, help="the gradient's largest norm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--stop-after", type=int, default=None,
                        help="stop after this many steps, as a preempted job would (run again to continue)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="where checkpoints go; an earlier run's there are continued (default: a temporary "
                             "directory, deleted at the end)")
    args = parser.parse_args()
    if min(args.replicas, args.steps, args.per_replica_batch, args.save_every) < 1:
        parser.error("--replicas, --steps, --per-replica-batch and --save-every must be at least 1")
    if args.stop_after is not None and args.checkpoint_dir is None:
        parser.error("--stop-after leaves a checkpoint to continue from: give --checkpoint-dir too")

    strategy = mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(args.replicas)], seed=args.seed)
    global_batch = args.per_replica_batch * strategy.num_replicas_in_sync
    train, held_out = blocks(additions(6000, args.seed)), blocks(additions(500, args.seed + 1))
    train_iterator = iter(strategy.experimental_distribute_dataset(
        mr.data.Dataset.from_tensor_slices(train).shuffle(len(train), seed=args.seed)
        .batch(global_batch, drop_remainder=True).repeat()))
    held_out_ds = strategy.experimental_distribute_dataset(
        mr.data.Dataset.from_tensor_slices(held_out).batch(global_batch))

    config = GPT2Config(vocab_size=len(VOCAB), n_positions=BLOCK, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=NEWLINE, eos_token_id=NEWLINE, pad_token_id=NEWLINE)
    torch.manual_seed(args.seed)
    with strategy.scope():
        model = strategy.mirror(GPT2LMHeadModel(config))
        optimizer = strategy.mirror_optimizer(torch.optim.AdamW, model, gradient_reduction="mean",
                                              lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
        step = mr.Variable(0, trainable=False)  # a mirrored counter: steps done
    schedule = get_cosine_schedule_with_warmup(optimizer, args.warmup, args.steps)
    optimizer.attach_lr_scheduler(schedule)  # its place is saved and restored with the optimizer

    directory = args.checkpoint_dir or tempfile.mkdtemp(prefix="hf_gpt2-")
    checkpoint = mr.train.Checkpoint(model=model, optimizer=optimizer, iterator=train_iterator, step=step)
    manager = mr.train.CheckpointManager(checkpoint, directory, max_to_keep=2)
    checkpoint.restore(manager.latest_checkpoint)
    if manager.latest_checkpoint:
        print(f"continuing from {manager.latest_checkpoint} at step {int(step)}")

    def train_step(input_ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=input_ids, labels=input_ids).loss  # the model shifts the labels itself
        loss.backward()  # gradient_reduction="mean": averaged across replicas as backward ends
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # so this clips the average
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    def held_out_step(input_ids: torch.Tensor) -> torch.Tensor:
        if not len(input_ids):  # a short last batch leaves a replica no rows, which GPT-2's attention refuses
            return torch.zeros(())
        with torch.no_grad():  # (grad mode is per thread: switched off inside the replica)
            return model(input_ids=input_ids, labels=input_ids).loss * len(input_ids)

    print(f"{strategy.num_replicas_in_sync} replicas, global batch {global_batch} x {BLOCK} tokens, "
          f"{sum(p.numel() for p in model.parameters())} parameters, checkpoints in {directory}")
    start, losses = time.perf_counter(), []
    model.train()
    while int(step) < args.steps:
        losses.append(strategy.reduce(mr.ReduceOp.MEAN, strategy.run(train_step, args=(next(train_iterator),)),
                                      axis=None))
        schedule.step()
        step.assign_add(1)
        if int(step) % args.save_every == 0 or int(step) == args.steps:
            manager.save()
            print(f"step {int(step)}: loss {torch.stack(losses).mean().item():.4f}  learning rate "
                  f"{schedule.get_last_lr()[0]:.2e}  ({time.perf_counter() - start:.1f} s)")
            losses = []
        if int(step) == args.stop_after:
            print(f"stopped after step {int(step)}; the latest checkpoint is {manager.latest_checkpoint}")
            return

    model.eval()
    total = sum(strategy.reduce(mr.ReduceOp.SUM, strategy.run(held_out_step, args=(x,)), axis=None).item()
                for x in held_out_ds)
    strategy.check_in_sync([model, optimizer])  # raises if any replica's copy drifted by a single bit
    copies = strategy.experimental_local_results(model)
    assert all(c.lm_head.weight is c.transformer.wte.weight for c in copies), "a copy lost GPT-2's tied weights"
    print("replicas in sync: parameters and AdamW's moments are bitwise identical; each copy's output layer is "
          "its token embedding")
    print(f"held-out loss {total / len(held_out):.4f} (a uniform guess: {torch.log(torch.tensor(len(VOCAB))):.4f})")
    print("completions:", "  ".join(complete(copies[0], p) for p in ("2+7=", "9+9=", "7+8=", "3+4=")))
    if args.checkpoint_dir is None:
        shutil.rmtree(directory)


if __name__ == "__main__":
    main()
