"""A small transformer trained on random data with a checkpoint every N steps.

Runs three times over the same steps and prints the mean step time of each:
no checkpoint, torch's async checkpoint (``dcp.async_save`` with its default
stager), and ckptio's (``ckptio.staging.DefaultStager`` + ``ckptio.dcp``
writer). Then it resumes from ckptio's last checkpoint and checks that the loss
curve continues exactly as in an uninterrupted run.

    python examples/train_async_checkpoint.py --steps 40 --every 10 [--device cuda]
"""

from __future__ import annotations

import argparse
import os
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


def train(args, mode: str, ckpt_dir: str, start: dict | None = None) -> tuple[float, list[float]]:
    """Mean step time (s) and the loss curve of one run. ``mode``: none | torch | ckptio."""
    model = make_model(args.dim, args.layers, args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first = 0
    if start is not None:  # resume: load model and optimizer state in place
        sd = state(model, opt, 0)
        before = memory(model, opt)
        # ckptio's reader reads each tensor straight into the model's and the
        # optimizer's own tensors (no copy of the checkpoint in memory).
        dcp.load(sd, storage_reader=FileSystemReader(start["dir"]), no_dist=True)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        if memory(model, opt) != before:
            raise SystemExit("the resume replaced tensors instead of filling them in place")
        first = sd["step"]
    stager = DefaultStager(StagingOptions(use_shared_memory=False)) if mode == "ckptio" else None
    pending = None
    losses, times = [], []
    for step in range(first, args.steps):
        t0 = time.perf_counter()
        x, y = batch(step, args.dim, args.device)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if pending is not None and hasattr(pending, "staging_completion"):
            pending.staging_completion.result()  # the snapshot is taken: params may change
        opt.step()
        losses.append(loss.item())
        if mode != "none" and (step + 1) % args.every == 0:
            if pending is not None:  # one checkpoint in flight at a time
                (getattr(pending, "upload_completion", None) or pending).result()
            sd = state(model, opt, step + 1)
            path = os.path.join(ckpt_dir, mode, f"step{step + 1}")
            if mode == "torch":
                pending = dcp.async_save(sd, checkpoint_id=path, no_dist=True)
            else:
                pending = dcp.async_save(
                    sd, storage_writer=FileSystemWriter(path), async_stager=stager, no_dist=True
                )
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if pending is not None:
        (getattr(pending, "upload_completion", None) or pending).result()
    if stager is not None:
        stager.close()
    return sum(times) / len(times), losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    ckpt_dir = args.dir or tempfile.mkdtemp(prefix="ckptio_example_")
    if args.device == "cuda":
        torch.backends.cudnn.deterministic = True
        torch.use_deterministic_algorithms(True, warn_only=True)
    results = {}
    for mode in ("none", "torch", "ckptio"):
        results[mode] = train(args, mode, ckpt_dir)
        print(f"{mode:>7}: {results[mode][0] * 1e3:8.1f} ms/step", flush=True)
    base = results["none"][1]
    last = (args.steps // args.every) * args.every
    resumed_at = last - args.every  # resume from the one before last: steps left to compare
    _, resumed = train(
        args, "none", ckpt_dir, start={"dir": os.path.join(ckpt_dir, "ckptio", f"step{resumed_at}")}
    )
    same = resumed == base[resumed_at:]
    print(f"resumed in place from step {resumed_at}: loss curve continues exactly: {same}")
    if not same:
        raise SystemExit(f"loss curves differ: {resumed[:3]} vs {base[resumed_at:][:3]}")


if __name__ == "__main__":
    main()
