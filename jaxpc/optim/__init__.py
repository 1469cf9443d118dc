"""Training: EM as optax-style transformations, gradient training that stays normalized, and
whole-epoch executables.

* :func:`em`, :func:`full_batch_em`, :func:`anemone`: EM optimizers with optax's ``init``/``update``
  protocol (they consume *flows* where optax consumes gradients; see :mod:`jaxpc.optim.transforms`).
* :func:`normalize` / :func:`normalize_params`: unconstrained logits -> normalized log-parameters
  (log-softmax per sum node over its children, per categorical row); :func:`log_prob` evaluates logits.
* :func:`apply`: one update for either kind of optimizer; :func:`make_step`: a pure training step;
  :func:`check_schedule`: an EM step size schedule's values over a range of counts.
* :func:`fit`: epochs as single ``lax.scan`` executables, with a progress bar and the LL curve.
"""

from .normalize import log_prob, mean_nll, normalize, normalize_params, normalized_log_prob, segment_log_softmax
from .train import FitResult, epoch_batches, fit, make_step
from .transforms import (
                         EMConfig,
                         EMState,
                         EMTransformation,
                         FullBatchEMState,
                         anemone,
                         anemone_update,
                         apply,
                         apply_updates,
                         check_schedule,
                         deltas,
                         em,
                         em_apply,
                         full_batch_em,
)

__all__ = [
    "em", "full_batch_em", "anemone", "EMTransformation", "EMState", "FullBatchEMState", "EMConfig",
    "apply", "apply_updates", "deltas", "em_apply", "anemone_update", "check_schedule",
    "normalize", "normalize_params", "segment_log_softmax", "log_prob", "normalized_log_prob", "mean_nll",
    "make_step", "epoch_batches", "fit", "FitResult",
]
