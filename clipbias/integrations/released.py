"""What each integration releases beside the model, outside the mechanism: the entries of its
``PrivacyReport.released`` (``Session(released=...)``), in one place so that they can be read, and kept
complete, together. Each is a statistic of the private data that the framework computes, logs or derives
without noise; the guarantee covers the model's updates only."""


N_RELEASED = "n, the number of training examples (the sampling rate B / n and the steps per epoch derive from it)"
TIMES_RELEASED = "the run's timings (steps per second, runtime: they grow with the private batches' sizes)"


SIZES_RELEASED = ("the private batches' sizes, through public data whose size follows them (a forward on generated data of "
                  "len(x) rows, as a DCGAN's torch.randn(batch_size, nz)): each step's public term, clipped per row or "
                  "exact, is a function of that count")
"""What a run releases where a public forward has as many rows as the private batch (``Session._follow``)."""


LOOP_RELEASED = (("what your loop reads from the private batches and prints, logs or keeps (loss.item(), accuracy): "
                  "statistics of the private data without noise"), N_RELEASED)
"""The Opacus interface's (``PrivacyEngine``): the user's own loop reads the batches."""

LIGHTNING_RELEASED = (("what training_step logs (self.log of the loss or accuracy on the private batches) and keeps "
                       "(training_step_outputs): statistics of the private data without noise"), TIMES_RELEASED,
                      N_RELEASED)
"""``DPCallback``'s (Lightning)."""

TRAINER_RELEASED = ("the training loss the Trainer logs (each private batch's mean example loss, no noise)",
                    TIMES_RELEASED, N_RELEASED)
"""``DPTrainer``'s (Hugging Face)."""
