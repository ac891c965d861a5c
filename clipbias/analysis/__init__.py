"""Instruments that are not private: the gradient diagnostics of Chen et al. and Xiao et al.
(``diagnostics``, figures in ``diagnostics_plots``) and the papers' toy problems run through the
engine (``toy``). Nothing here is imported by the training path."""
