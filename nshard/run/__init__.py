"""The training run: plan, data, loss, models, replay, receipts, resumable state and the run directory."""
