"""What nshard reads from the engine for its per-update figures: DeepSpeed's own monitor (tensorboard, csv_monitor,
wandb, comet), carrying nshard's figures on one step axis, and the global gradient norm after reduction."""

from __future__ import annotations

import torch

PREFIX = "Train/Samples/"
TAGS = {"loss": "train_loss", "lr": "lr", "update_s": "update_s", "tokens_per_s": "tokens_per_s",
        "response_tokens_per_s": "response_tokens_per_s", "achieved_tflops": "achieved_tflops", "mfu": "mfu",
        "grad_norm": "grad_norm", "grad_bytes": "grad_bytes", "parameter_bytes": "parameter_bytes",
        "compression_error_norm": "compression_error_norm"}
"""metrics.jsonl key -> monitor tag under Train/Samples/ (DeepSpeed's own names for the loss and the rate)."""
OWN_TAGS = frozenset(PREFIX + tag for tag in TAGS.values())
STEP = ("documents trained through the update (all ranks): DeepSpeed's samples axis, counted by nshard, for "
        "nshard's events and DeepSpeed's own alike")


class Monitor:
    """Stands in for engine.monitor. DeepSpeed's own events pass through, except those whose tag nshard writes
    (its lr, read after the scheduler stepped, is the next update's rate; a train_loss, which DeepSpeed 0.19.8's
    engine no longer writes, would be whatever loss nshard handed engine.backward), and every event is put on
    nshard's step: the documents trained through the update (DeepSpeed's global_samples counts microbatch slots,
    fillers included, and one micro-step per update on the ingest seam)."""

    def __init__(self, inner):
        self.inner, self.samples = inner, 0

    @property
    def enabled(self) -> bool:
        return self.inner.enabled

    @classmethod
    def install(cls, engine) -> "Monitor | None":
        """Put a Monitor in place of the engine's when the ds_config enables any monitor; else None."""
        if not engine.monitor.enabled:
            return None
        engine.monitor = cls(engine.monitor)
        return engine.monitor

    def write_events(self, events) -> None:  # DeepSpeed's calls (inside engine.step)
        kept = [(tag, value, self.samples) for tag, value, *_ in events if tag not in OWN_TAGS]
        if kept:
            self.inner.write_events(kept)

    def write(self, record: dict, samples: int) -> None:
        """nshard's figures of one update (the metrics.jsonl record itself, so the values are the same floats);
        DeepSpeed's MonitorMaster writes on rank 0 only."""
        self.inner.write_events([(PREFIX + tag, record[key], samples) for key, tag in TAGS.items()
                                 if record.get(key) is not None])

    def close(self) -> None:
        """Finish what the monitors hold open (rank 0 only has any). The trainer leaves through os._exit, which
        runs no atexit handler: without this a wandb run is never finished and its history never written."""
        tb = getattr(getattr(self.inner, "tb_monitor", None), "summary_writer", None)
        if tb is not None:
            tb.close()
        if getattr(self.inner, "wandb_monitor", None) is not None:
            import wandb

            wandb.finish()
        experiment = getattr(getattr(self.inner, "comet_monitor", None), "experiment", None)
        if experiment is not None:
            experiment.end()


class GradNorm:
    """The 2-norm of the whole reduced gradient before clipping, identical on every rank. Where DeepSpeed's
    optimizer computes it for clipping (ZeRO-1/2/3 from the reduced partitions, all-reduced; bf16 and fp16 at
    stage 0), engine.get_global_grad_norm(). At stage 0 in fp32 DeepSpeed clips torch's AdamW gradients but
    keeps no norm: with gradient_clipping set, the norm its clip_grad_norm_ returns is kept; without clipping,
    nshard takes it from .grad when step() is called at the accumulation boundary: the gradients are reduced by
    then (every rank holds the same), and not yet clipped."""

    def __init__(self, engine):
        self.engine, self.ours = engine, None
        self.source = "deepspeed: engine.get_global_grad_norm()"
        if engine.zero_optimization_stage() == 0 and not (engine.bfloat16_enabled() or engine.fp16_enabled()) \
                and engine.gradient_clipping() > 0:
            # DeepSpeed computes the norm to clip by and drops it: keep what its own clip_grad_norm_ returns (the same
            # call, arguments and arithmetic as engine.clip_fp32_gradients), so no second pass runs in the update.
            from nshard.seam import patches

            self.source = "deepspeed: clip_grad_norm_ at stage 0, the norm it clips by (before clipping)"
            patches.keep_clip_norm(engine, lambda norm: setattr(self, "ours", norm))
        elif engine.zero_optimization_stage() == 0 and not (engine.bfloat16_enabled() or engine.fp16_enabled()):
            self.source = "nshard: .grad at stage 0's accumulation boundary, before clipping"
            step = engine.step

            def step_with_norm(*args, **kwargs):
                if engine.is_gradient_accumulation_boundary():
                    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
                    self.ours = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) if grads else None
                return step(*args, **kwargs)

            engine.step = step_with_norm

    def take(self) -> float | None:
        """The last update's norm (read after the update's closing synchronization: no extra wait on a GPU)."""
        if self.source.startswith(("nshard", "deepspeed: clip_grad_norm_")):
            norm, self.ours = self.ours, None
        else:
            norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)
