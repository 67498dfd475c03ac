"""A small transformer trained on random data with an async checkpoint every N steps.

Three trainers run side by side: no checkpoint, torch's async checkpoint
(``dcp.async_save`` with its default stager), and ckptio's
(``ckptio.staging.DefaultStager`` + the ``ckptio.dcp`` writer). Each is warmed up
first (one checkpoint included), then the three take turns over ``--rounds``
rounds of ``--steps`` steps, the order rotated each round, so that no trainer pays
the warm-up or a quiet moment of the machine alone. It prints, per trainer, the
median step time and, what a checkpoint costs training, the time the training
loop was blocked per checkpoint (the call, the wait for the snapshot before the
optimizer may step, the wait for the previous checkpoint), with their spread.
Then it resumes from ckptio's second to last checkpoint, in place, and checks
that the loss curve continues exactly.

    python examples/train_async_checkpoint.py --steps 40 --every 10 --rounds 3 [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from ckptio.dcp import FileSystemReader, FileSystemWriter
from ckptio.staging import DefaultStager, StagingOptions
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

warnings.simplefilter("ignore")
MODES = ("none", "torch", "ckptio")


def make_model(dim: int, layers: int, device: str) -> nn.Module:
    torch.manual_seed(0)
    # No dropout: the resumed run must see the same randomness (none) as the original.
    layer = nn.TransformerEncoderLayer(
        dim, nhead=8, dim_feedforward=4 * dim, dropout=0.0, batch_first=True
    )
    return nn.Sequential(nn.TransformerEncoder(layer, layers), nn.Linear(dim, dim)).to(device)


def batch(step: int, dim: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + step)  # data depends only on the step
    x = torch.randn(16, 64, dim, generator=g)
    return x.to(device), x.flip(1).to(device)


def state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    # get_state_dict gives DCP's flat layout and initialises empty optimizer state,
    # so a fresh optimizer can be loaded in place.
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd, "step": step}


def memory(model: nn.Module, opt: torch.optim.Optimizer) -> list[int]:
    """Where the parameters and the optimizer's state tensors live."""
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return [t.data_ptr() for t in [*model.parameters(), *state]]


class Trainer:
    """One training run, advanced a few steps at a time. ``mode``: none | torch | ckptio."""

    def __init__(self, args, mode: str, ckpt_dir: str, resume_from: str | None = None) -> None:
        self.args, self.mode, self.ckpt_dir = args, mode, ckpt_dir
        self.model = make_model(args.dim, args.layers, args.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.step = 0
        if resume_from is not None:  # load model and optimizer state in place
            sd = state(self.model, self.opt, 0)
            before = memory(self.model, self.opt)
            # ckptio's reader reads each tensor straight into the model's and the
            # optimizer's own tensors (no copy of the checkpoint in memory).
            dcp.load(sd, storage_reader=FileSystemReader(resume_from), no_dist=True)
            set_state_dict(
                self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
            )
            if memory(self.model, self.opt) != before:
                raise SystemExit("the resume replaced tensors instead of filling them in place")
            self.step = sd["step"]
        self.stager = (
            DefaultStager(StagingOptions(use_shared_memory=False)) if mode == "ckptio" else None
        )
        self.pending = None
        self.losses: dict[int, float] = {}
        self.step_times: list[float] = []
        self.blocked: list[float] = []  # training time blocked, per checkpoint

    def _wait(self, what: str) -> float:
        """Wait for the checkpoint in flight (``staged`` or ``durable``); seconds blocked."""
        if self.pending is None:
            return 0.0
        t0 = time.perf_counter()
        if what == "staged":
            staged = getattr(self.pending, "staging_completion", None)
            if staged is not None:
                staged.result()
        else:
            (getattr(self.pending, "upload_completion", None) or self.pending).result()
            self.pending = None
        return time.perf_counter() - t0

    def run(self, steps: int, timed: bool = True) -> None:
        a = self.args
        for _ in range(steps):
            t0 = time.perf_counter()
            x, y = batch(self.step, a.dim, a.device)
            loss = nn.functional.mse_loss(self.model(x), y)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            blocked = self._wait("staged")  # the snapshot is taken: parameters may change
            self.opt.step()
            self.losses[self.step] = loss.item()
            self.step += 1
            if self.mode != "none" and self.step % a.every == 0:
                t1 = time.perf_counter()
                self._wait("durable")  # one checkpoint in flight at a time
                sd = state(self.model, self.opt, self.step)
                path = os.path.join(self.ckpt_dir, self.mode, f"step{self.step}")
                if self.mode == "torch":
                    self.pending = dcp.async_save(sd, checkpoint_id=path, no_dist=True)
                else:
                    self.pending = dcp.async_save(
                        sd,
                        storage_writer=FileSystemWriter(path),
                        async_stager=self.stager,
                        no_dist=True,
                    )
                blocked += time.perf_counter() - t1
                if timed:
                    self.blocked.append(blocked)
            elif blocked and timed and self.blocked:
                self.blocked[-1] += blocked  # the snapshot's wait, one step later
            if a.device == "cuda":
                torch.cuda.synchronize()
            if timed:
                self.step_times.append(time.perf_counter() - t0)

    def end_turn(self, timed: bool = True) -> None:
        """Let the checkpoint in flight finish before another trainer runs. Its
        snapshot's wait counts as blocked, as if no step had overlapped it."""
        staged = self._wait("staged")
        if timed and self.blocked:
            self.blocked[-1] += staged
        self._wait("durable")

    def close(self) -> None:
        self.end_turn(timed=False)
        if self.stager is not None:
            self.stager.close()


def spread(xs: list[float], scale: float = 1e3) -> str:
    """median [min-max], in ms."""
    if not xs:
        return "-"
    return f"{statistics.median(xs) * scale:8.1f} [{min(xs) * scale:.1f}-{max(xs) * scale:.1f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="steps per trainer per round")
    ap.add_argument("--every", type=int, default=10, help="a checkpoint every N steps")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    if args.steps < args.every:
        ap.error("--steps must be at least --every: each round checkpoints at least once")
    ckpt_dir = args.dir or tempfile.mkdtemp(prefix="ckptio_example_")
    if args.device == "cuda":
        torch.backends.cudnn.deterministic = True
        torch.use_deterministic_algorithms(True, warn_only=True)
    trainers = {m: Trainer(args, m, ckpt_dir) for m in MODES}
    for t in trainers.values():  # warm-up: first steps, first checkpoint, first stager buffers
        t.run(args.every, timed=False)
        t.end_turn(timed=False)
    for r in range(args.rounds):
        order = MODES[r % 3 :] + MODES[: r % 3]
        for m in order:
            trainers[m].run(args.steps)
            trainers[m].end_turn()  # its checkpoint ends inside its own turn
    for t in trainers.values():
        t.close()
    steps = args.rounds * args.steps
    print(
        f"{args.rounds} rounds x {args.steps} steps per trainer, a checkpoint every {args.every} "
        f"steps, {args.device}; median [min-max] in ms, after a warm-up"
    )
    print(f"{'':>7}  {'step time':>26}  {'training blocked per checkpoint':>34}")
    for m in MODES:
        t = trainers[m]
        n = f"({len(t.blocked)} checkpoints)" if t.blocked else ""
        print(f"{m:>7}  {spread(t.step_times):>26}  {spread(t.blocked):>24} {n}", flush=True)
    base = trainers["none"].losses
    same_run = all(trainers[m].losses == base for m in MODES)
    print(f"checkpointing left training unchanged (same losses): {same_run}")
    total = args.every + steps  # the warm-up's steps and the rounds'
    last = total // args.every * args.every  # the last checkpoint's step
    resumed_at = last - args.every  # the one before: steps left to compare
    resumed = Trainer(
        args, "none", ckpt_dir, resume_from=os.path.join(ckpt_dir, "ckptio", f"step{resumed_at}")
    )
    resumed.run(total - resumed_at, timed=False)
    want = {s: base[s] for s in resumed.losses}
    same = resumed.losses == want
    print(f"resumed in place from step {resumed_at}: loss curve continues exactly: {same}")
    if not same or not same_run:
        raise SystemExit(
            f"loss curves differ: {list(resumed.losses.values())[:3]} vs {list(want.values())[:3]}"
        )


if __name__ == "__main__":
    main()
