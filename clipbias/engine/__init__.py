"""The engine: one private training run's moving parts (sampler, row source, pipeline, optimizer,
accountant) with one private ``state_dict`` (``core``: ``DPEngine``) and the one sample-and-step loop
everything trains with (``run_steps``). Several processes: ``clipbias.distributed``."""

from .core import AUTO_ROWS_BYTES, SEEDED_CAVEAT, DPEngine, PrivacySettings, run_steps

__all__ = ["AUTO_ROWS_BYTES", "DPEngine", "PrivacySettings", "SEEDED_CAVEAT", "run_steps"]
