"""jaxpc.nn.CircuitModule: a circuit inside Flax NNX models, trained by nnx.Optimizer or by EM."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

nnx = pytest.importorskip("flax.nnx")

import jaxpc  # noqa: E402
from jaxpc import distributions, optim  # noqa: E402
from jaxpc.nn import CircuitModule, CircuitTables  # noqa: E402

from .test_optim import _maxdiff, _sum_node_totals  # noqa: E402


@pytest.fixture(scope="module")
def circuit():
    a = jaxpc.inputs(0, 2, 2, distributions.Categorical(3))
    b = jaxpc.inputs(1, 2, 2, distributions.Categorical(3))
    inner = jaxpc.summate(jaxpc.multiply(a, b), num_node_blocks=2, block_size=2)
    return jaxpc.compile(jaxpc.summate(inner, num_nodes=1), seed=4)


X = np.asarray(list(itertools.product(range(3), range(3))), np.int32)


class SoftEvidenceModel(nnx.Module):
    """An nnx.Linear maps features to per-variable soft evidence for the circuit."""

    def __init__(self, circuit, rngs):
        self.enc = nnx.Linear(4, 2 * 3, rngs=rngs)
        self.pc = CircuitModule(circuit)

    def __call__(self, feats):
        q = jax.nn.softmax(self.enc(feats).reshape(-1, 2, 3))
        return self.pc(soft_evidence=q)


@pytest.mark.slow
def test_module_evaluates_like_the_circuit_and_round_trips(circuit):
    m = CircuitModule(circuit)
    np.testing.assert_allclose(m(X), circuit.log_prob(circuit.params, X), rtol=1e-5)
    miss = np.array([False, True])
    np.testing.assert_allclose(m(X, miss), circuit.log_prob(circuit.params, X, miss), rtol=1e-5)
    onehot = jax.nn.one_hot(X, 3)
    np.testing.assert_allclose(m(soft_evidence=onehot), circuit.log_prob(circuit.params, X), rtol=1e-5)
    graphdef, state = nnx.split(m)
    assert nnx.state(m, nnx.Param) and nnx.state(m, CircuitTables)
    m2 = nnx.merge(graphdef, state)
    np.testing.assert_array_equal(np.asarray(m2(X)), np.asarray(m(X)))
    assert m2.circuit is circuit
    assert _maxdiff(m2.raw_params(), circuit.params) == 0.0


@pytest.mark.slow
def test_soft_evidence_model_trains_with_nnx_optimizer(circuit):
    model = SoftEvidenceModel(circuit, nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)
    feats = jax.random.normal(jax.random.key(0), (32, 4))

    @nnx.jit
    def step(model, opt, f):
        loss, grads = nnx.value_and_grad(lambda m: -jnp.mean(m(f)))(model)
        opt.update(model, grads)
        return loss, grads

    loss0, grads = step(model, opt, feats)
    # gradients reach both the linear layer and the circuit's parameters
    assert float(jnp.abs(grads["enc"]["kernel"][...]).max()) > 0
    assert max(float(jnp.abs(g[...]).max()) for g in jax.tree_util.tree_leaves(
        grads["pc"]["params"], is_leaf=lambda v: isinstance(v, nnx.Variable))) > 0
    for _ in range(40):
        loss, _ = step(model, opt, feats)
    assert float(loss) < float(loss0) - 0.1
    p = model.pc.get_params()  # the stored logits moved off the normalized set; get_params renormalizes
    assert float(jnp.sum(jnp.exp(circuit.log_prob(p, X)))) == pytest.approx(1.0, abs=1e-5)
    np.testing.assert_allclose(_sum_node_totals(circuit, p), 1.0, rtol=1e-5)


@pytest.mark.slow
def test_em_on_the_module_equals_circuit_em_step(circuit):
    m = CircuitModule(circuit)
    ll = nnx.jit(lambda m, x: m.em_step(x, step_size=0.5, pseudocount=0.1))(m, X[:6])
    ref, ll_ref = circuit.em_step(circuit.params, X[:6], step_size=0.5, pseudocount=0.1, return_ll=True)
    np.testing.assert_allclose(ll, ll_ref, rtol=1e-6)
    assert _maxdiff(m.raw_params(), ref) < 1e-6
    # and EM transformations drive the module's params like any params pytree
    tx = optim.em(circuit, 0.5, 0.1)
    p, _ = tx.step(circuit.flows(m.get_params(), X), tx.init(ref), m.get_params())
    m.set_params(p)
    assert _maxdiff(m.raw_params(), p) == 0.0


@pytest.mark.slow
def test_the_modules_options_apply_to_its_em_step(circuit):
    """A module's options are those of its EM step too: with ``propagation="MPE"`` the step is hard (Viterbi) EM,
    equal to ``Circuit.em_step`` with the same options; options that give no linear flows raise."""
    mpe = jaxpc.Options(propagation="MPE")
    m = CircuitModule(circuit, options=mpe)
    ll = m.em_step(X[:6], step_size=0.5, pseudocount=0.1)
    ref, ll_ref = circuit.em_step(circuit.params, X[:6], step_size=0.5, pseudocount=0.1, options=mpe, return_ll=True)
    soft, _ = circuit.em_step(circuit.params, X[:6], step_size=0.5, pseudocount=0.1, return_ll=True)
    np.testing.assert_allclose(ll, ll_ref, rtol=1e-6)
    assert _maxdiff(m.raw_params(), ref) < 1e-6 and _maxdiff(ref, soft) > 1e-3
    for options, match in ((jaxpc.Options(negate_flows=True), "not negated flows"),
                           (jaxpc.Options(logspace_flows=True), "gives log flows")):
        with pytest.raises(ValueError, match=match):
            CircuitModule(circuit, options=options).em_step(X[:6])


def test_module_rejects_bad_inputs(circuit):
    m = CircuitModule(circuit)
    with pytest.raises(TypeError, match="jaxpc.Circuit"):
        CircuitModule("circuit")
    with pytest.raises(ValueError, match="structure"):
        CircuitModule(circuit, params={"sum": {}})
    with pytest.raises(ValueError, match="soft_evidence must have shape"):
        m(soft_evidence=jnp.ones((2, 3, 3)))
    # the rules of circuit.marginal's soft evidence, named by the module
    for bad, err, msg in ((jnp.ones((0, 2, 3)), ValueError, r"CircuitModule: soft_evidence has an empty batch"),
                          (jnp.ones((4, 2, 2)), ValueError, r"CircuitModule: soft_evidence has 2 values per variable"),
                          (jnp.ones((4, 2, 3), jnp.int32), TypeError, r"CircuitModule: .*got dtype int32")):
        with pytest.raises(err, match=msg):
            m(soft_evidence=bad)
        with pytest.raises(err, match=msg.replace("CircuitModule", "circuit.marginal")):
            circuit.marginal(circuit.params, soft_evidence=bad)
    with pytest.raises(ValueError, match="not both"):
        m(X, soft_evidence=jnp.ones((9, 2, 3)))
    with pytest.raises(ValueError, match="needs x"):
        m()


def test_module_em_step_checks_step_size_and_pseudocount_as_the_circuit_does(circuit):
    """``CircuitModule.em_step`` rejects the EM arguments ``Circuit.em_step`` rejects, with the same error, and leaves
    its parameters as they were."""
    m = CircuitModule(circuit)
    before = m.raw_params()
    for kw in ({"step_size": 2.0}, {"step_size": 0.0}, {"pseudocount": -1.0}, {"pseudocount": float("inf")}):
        with pytest.raises(ValueError) as want:
            circuit.em_step(circuit.params, X[:6], **kw)
        with pytest.raises(ValueError) as got:
            m.em_step(X[:6], **kw)
        assert str(got.value) == str(want.value), kw
    assert _maxdiff(m.raw_params(), before) == 0.0


def test_module_checks_soft_evidence_values_and_set_params_shapes(circuit):
    """Soft evidence is checked as ``Circuit.marginal`` checks it (a host array's values at once, a device array's
    on the device, raised by the next call); ``set_params`` rejects another structure or shape when it is called,
    not at the next forward."""
    m = CircuitModule(circuit)
    for bad in (-1.0, np.nan):
        q = np.ones((2, 2, 3), np.float32)
        q[1, 0, 2] = bad
        with pytest.raises(ValueError, match=r"soft_evidence\[1, 0, 2\] = .*finite and non-negative.*CircuitModule"):
            m(soft_evidence=q)
    q = np.ones((2, 2, 3), np.float32)
    q[0, 1, 1] = -1.0
    m(soft_evidence=jnp.asarray(q))
    with pytest.raises(ValueError, match=r"soft_evidence\[0, 1, 1\] = -1.0.*checked on the device"):
        circuit.raise_pending()
    before = m.raw_params()
    with pytest.raises(ValueError, match="has shape"):
        m.set_params(jax.tree_util.tree_map(lambda a: a[:1], circuit.params))
    with pytest.raises(ValueError, match="does not have the structure of this circuit's params"):
        m.set_params({"sum": circuit.params["sum"]})
    assert _maxdiff(m.raw_params(), before) == 0.0
