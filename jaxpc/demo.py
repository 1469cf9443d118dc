"""The main demo: learn a hidden Chow-Liu tree on scikit-learn's digits (no download) with
mini-batch EM, then report train/test log-likelihood and bits per dimension.

    python -m jaxpc.demo [--latents 32] [--epochs 40] [--batch-size 128] ...
"""

from __future__ import annotations

import argparse
import math
import time


def load_digits_split(seed: int = 0, test_fraction: float = 0.2):
    """scikit-learn's 1,797 8x8 digits (17 gray levels), shuffled and split."""
    import numpy as np
    from sklearn.datasets import load_digits

    x = load_digits().data.astype(np.int32)
    perm = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(test_fraction * len(x)))
    return x[perm[n_test:]], x[perm[:n_test]]


def _int_at_least(low: int):
    """An argparse ``type``: an integer ``>= low`` (argparse names the option and the value otherwise)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    return parse


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--latents", type=_int_at_least(1), default=32, help="latent states per variable (default 32)")
    p.add_argument("--epochs", type=_int_at_least(0), default=40)
    p.add_argument("--batch-size", type=_int_at_least(1), default=128)
    p.add_argument("--step-size", type=float, default=0.2, help="initial EM step size (decays linearly to 10%%)")
    p.add_argument("--pseudocount", type=float, default=0.1)
    p.add_argument("--seed", type=_int_at_least(0), default=0)
    args = p.parse_args(argv)

    import jax
    import numpy as np
    from tqdm.auto import tqdm

    import jaxpc
    from jaxpc import distributions, structures

    train, test = load_digits_split(args.seed)
    num_vars = train.shape[1]
    print(f"digits: {len(train)} train / {len(test)} test images, {num_vars} pixels, 17 gray levels; "
          f"jax {jax.__version__} on {jax.devices()[0].platform}")

    t0 = time.perf_counter()
    root = structures.HCLT(train, num_latents=args.latents, input_dist=distributions.Categorical(num_cats=17))
    t1 = time.perf_counter()
    circuit = jaxpc.compile(root, seed=args.seed)
    t2 = time.perf_counter()
    print(f"HCLT-{args.latents}: {circuit.num_nodes:,} nodes, {circuit.num_edges:,} edges, "
          f"{circuit.num_parameters:,} parameters (structure {t1 - t0:.1f} s, jaxpc.compile {t2 - t1:.2f} s)")

    params = circuit.params
    rng = np.random.default_rng(args.seed)
    bs = min(args.batch_size, len(train))
    steps_per_epoch = len(train) // bs
    total = args.epochs * steps_per_epoch
    step = 0
    bar = tqdm(range(args.epochs), desc="mini-batch EM", unit="epoch")
    for _ in bar:
        perm = rng.permutation(len(train))
        lls = []
        for i in range(steps_per_epoch):
            xb = train[perm[i * bs:(i + 1) * bs]]
            s = args.step_size * (1.0 - 0.9 * step / max(total - 1, 1))
            params, ll = circuit.em_step(params, xb, step_size=s, pseudocount=args.pseudocount, return_ll=True)
            lls.append(ll)
            step += 1
        bar.set_postfix(train_ll=f"{float(np.mean(np.concatenate([np.asarray(v) for v in lls]))):.2f}")

    def mean_ll(x):
        return float(np.mean(np.asarray(circuit.log_prob(params, x))))

    train_ll, test_ll = mean_ll(train), mean_ll(test)
    to_bpd = -1.0 / (num_vars * math.log(2.0))
    print(f"train LL {train_ll:.3f} nats/image   ({train_ll * to_bpd:.4f} bits per dimension)")
    print(f"test  LL {test_ll:.3f} nats/image   ({test_ll * to_bpd:.4f} bits per dimension)")
    return {"train_ll": train_ll, "test_ll": test_ll, "test_bpd": test_ll * to_bpd}


if __name__ == "__main__":
    main()
