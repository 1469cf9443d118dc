"""The README's main command stays runnable: a short run of the demo trains and beats uniform."""

import math

from jaxpc import demo


def test_demo_trains_hclt_on_digits(capsys):
    out = demo.main(["--epochs", "2", "--latents", "8", "--batch-size", "256"])
    text = capsys.readouterr().out
    assert "bits per dimension" in text and "HCLT-8" in text
    assert out["test_bpd"] < math.log2(17) - 1.0  # far better than a uniform model over 17 gray levels
    assert out["train_ll"] > out["test_ll"] - 20
