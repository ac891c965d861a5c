"""clipbias in your own training loop: the Opacus interface (``PrivacyEngine``, ``BatchMemoryManager``),
the model validator and fixer (``ModuleValidator``, ``fix``), and the Hugging Face and Lightning
integrations (imported on use: they need the ``hf`` and ``lightning`` extras)."""

from .opacus import BatchMemoryManager, DPDataLoader, DPModule, DPOptimizer, PrivacyEngine
from .validators import ModuleValidator, fix

__all__ = ["BatchMemoryManager", "DPDataLoader", "DPModule", "DPOptimizer", "ModuleValidator", "PrivacyEngine", "fix"]
