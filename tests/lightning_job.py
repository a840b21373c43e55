"""One generation of a PyTorch Lightning run saving through shardsafe (run as a script).

Lightning's own ``Trainer.fit`` with its ``ModelCheckpoint`` and ``ckpt_path`` resume; with
``--devices 2`` Lightning's ``ddp`` strategy relaunches this script for rank 1 (gloo on CPU).
Rank 0 writes the final state (module, optimizer, scheduler, progress) to ``--out`` with
``torch.save``, or the class of the error ``fit`` raised. ``--kill-in-save EPOCH`` SIGKILLs every
process of the run (the launcher and both ranks) in the middle of writing the first checkpoint
of that epoch, leaving a half-written save behind; ``--resume newest`` resumes from
``shardsafe.lightning.newest_checkpoint``, ``--resume last`` is Lightning's own.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any, NoReturn

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import shardsafe
import shardsafe.lightning


class Tiny(pl.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> object:
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)}


class Sharded(Tiny):
    """The same module, FSDP2-sharded over the data-parallel mesh in ``configure_model``."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.net[0], mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def kill_the_run() -> NoReturn:
    """SIGKILL the whole run at once (the test starts it in a process group of its own)."""
    os.killpg(os.getpgid(0), signal.SIGKILL)
    raise AssertionError("unreachable")  # pragma: no cover


class KillDuringSave(pl.Callback):
    """Lets the first checkpoint of ``epoch`` write a few bytes of data, then kills the run."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_save_checkpoint(self, trainer: pl.Trainer, *_: Any) -> None:
        if trainer.current_epoch == self.epoch:
            from faultinject import patch_data_writes

            patch_data_writes(64, kill_the_run)  # every rank: whichever writes first kills


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    return DataLoader(TensorDataset(x, torch.sin(x[:, :3])), batch_size=4, shuffle=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--epochs", type=int, required=True)
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--checkpoints", action="store_true")
    ap.add_argument("--save-last", action="store_true")
    ap.add_argument("--kill-in-save", type=int, default=None)
    ap.add_argument("--async-save", action="store_true")
    ap.add_argument("--model-parallel", action="store_true")
    ap.add_argument("--fsdp1", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.root, exist_ok=True)
    torch.manual_seed(1)
    model = Sharded() if args.model_parallel else Tiny()
    strategy: object = "ddp" if args.devices > 1 else "auto"
    if args.model_parallel:
        strategy = shardsafe.lightning.ModelParallelStrategy(
            data_parallel_size=args.devices, tensor_parallel_size=1
        )
    if args.fsdp1:
        strategy = shardsafe.lightning.FSDPStrategy()
    dirpath = os.path.join(args.root, "ckpts")
    callbacks: list[pl.Callback] = []
    if args.checkpoints:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=dirpath, every_n_epochs=1, save_top_k=1, save_last=args.save_last
            )
        )
    if args.kill_in_save is not None:
        callbacks.append(KillDuringSave(args.kill_in_save))
    resume = args.resume
    if resume == "newest":
        resume = shardsafe.lightning.newest_checkpoint(dirpath)
        assert resume is not None, f"no committed checkpoint in {dirpath}"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.epochs,
        plugins=[shardsafe.lightning.CheckpointIO(async_save=args.async_save)],
        callbacks=callbacks,
        enable_checkpointing=args.checkpoints,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.root,
    )
    try:
        trainer.fit(model, data(), ckpt_path=resume)
    except Exception as e:
        if trainer.global_rank == 0:
            with open(args.out + ".json", "w") as f:
                json.dump(
                    {
                        "error": type(e).__name__,
                        "checkpoint_error": isinstance(e, shardsafe.CheckpointError),
                        "message": str(e)[:2000],
                    },
                    f,
                )
        sys.exit(3)
    opt = trainer.optimizers[0]
    if args.model_parallel or args.fsdp1:  # every rank takes part in gathering the full state
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        # (cpu_offload=True crashes FSDP1's full state dict on CPU in torch 2.13; not needed)
        full = StateDictOptions(full_state_dict=True, cpu_offload=not args.fsdp1)
        wrapped = trainer.strategy.model if args.fsdp1 else model
        model_state = get_model_state_dict(wrapped, options=full)
        optim_state = get_optimizer_state_dict(wrapped, opt, options=full)
    else:
        model_state, optim_state = model.state_dict(), opt.state_dict()
    if trainer.global_rank == 0:
        torch.save(
            {
                "model": model_state,
                "optimizer": optim_state,
                "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                "global_step": trainer.global_step,
                "epoch": trainer.current_epoch,
                "best": trainer.checkpoint_callback.best_model_path
                if trainer.checkpoint_callback
                else None,
            },
            args.out,
        )


if __name__ == "__main__":
    main()
