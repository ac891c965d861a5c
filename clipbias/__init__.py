"""clipbias: differentially private training without clipping bias.

Data flows one way through small composable stages::

    sampler -> per-sample gradients -> per-sample stages -> aggregate
            -> error feedback -> noise -> base torch optimizer

See ``docs/architecture.md`` for the map of modules.
"""

__version__ = "0.1.0"

_LAZY = {"PrivacyEngine", "BatchMemoryManager", "ModuleValidator", "fix"}


def __getattr__(name: str):
    """``clipbias.PrivacyEngine`` (the Opacus interface), ``BatchMemoryManager``, ``ModuleValidator`` and
    ``fix``, ``example_generator`` (keyed per-example draws for a Dataset or collate_fn) and ``public``
    (tensors declared public for a forward in a private step: ``clipbias.integrations.rowtrace.public``),
    imported on first use: ``import clipbias`` (and the CLI's ``--help``) stays free of torch."""
    if name in _LAZY:
        from . import integrations
        return getattr(integrations, name)
    if name == "public":
        from .integrations import rowtrace
        return rowtrace.public
    if name in ("example_generator", "ExampleGenerator"):  # keyed per-example draws for a Dataset / collate_fn
        from .randomness import example
        return getattr(example, name)
    raise AttributeError(f"module 'clipbias' has no attribute {name!r}")
