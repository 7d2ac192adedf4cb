"""Mesh construction and validation, logical-axis rules, and a sharded train step on 8 fake CPU devices."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from marl_jax.train import sharding
import train_infra_util as util


def _mesh(data, fsdp, tensor):
    return sharding.make_mesh({"data": data, "fsdp": fsdp, "tensor": tensor})


def test_eight_fake_devices():
    assert jax.device_count() == 8


def test_make_mesh_shape_axes_and_devices():
    mesh = sharding.make_mesh(ml_collections.ConfigDict({"data": 1, "fsdp": 4, "tensor": 2}))
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 2}
    assert mesh.axis_types == (AxisType.Auto,) * 3
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


@pytest.mark.parametrize("config, expected", [
    ({"data": 2, "fsdp": -1, "tensor": 2}, (2, 2, 2)),
    ({"data": -1, "fsdp": 1, "tensor": 1}, (8, 1, 1)),
    ({"data": 1, "fsdp": 2, "tensor": -1}, (1, 2, 4)),
    ({"data": 2, "fsdp": 2, "tensor": 2}, (2, 2, 2)),
])
def test_minus_one_takes_the_remaining_devices(config, expected):
    assert sharding.validate_mesh(ml_collections.ConfigDict(config), 8) == expected
    mesh = sharding.make_mesh(config)
    assert tuple(mesh.shape[a] for a in sharding.MESH_AXES) == expected


def test_make_mesh_on_a_device_subset():
    mesh = sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 1}, devices=jax.devices()[:2])
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 1}


@pytest.mark.parametrize("config, message", [
    ({"data": 1, "fsdp": 3, "tensor": 2}, r"^config\.mesh\.fsdp=3 does not divide 8 devices$"),
    ({"data": 1, "fsdp": 4, "tensor": 3}, r"^config\.mesh\.tensor=3 does not divide 8 devices$"),
    ({"data": -1, "fsdp": -1, "tensor": 2}, r"only one of data, fsdp, tensor may be -1"),
    ({"data": 1, "fsdp": 2, "tensor": 2}, r"config\.mesh\.data=1 \* config\.mesh\.fsdp=2 \* "
                                          r"config\.mesh\.tensor=2 = 4 devices, but there are 8"),
    ({"data": -1, "fsdp": 4, "tensor": 4}, r"config\.mesh\.fsdp=4 \* config\.mesh\.tensor=4 = 16 "
                                           r"does not divide 8 devices"),
    ({"data": 0, "fsdp": -1, "tensor": 1}, r"config\.mesh\.data=0 must be a positive int or -1"),
    ({"data": 1, "fsdp": 2.0, "tensor": -1}, r"config\.mesh\.fsdp=2\.0 must be an int"),
    ({"data": 1, "fsdp": -1}, r"config\.mesh\.tensor is missing"),
])
def test_bad_mesh_config_names_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        sharding.validate_mesh(config, 8)
    with pytest.raises(ValueError, match=message):
        sharding.make_mesh(config)


def test_validate_batch():
    mesh = _mesh(1, 4, 2)
    sharding.validate_batch(8, mesh, "config.ppo.batch_size")
    with pytest.raises(ValueError, match=r"^config\.ppo\.batch_size=6 is not divisible by the 4 "
                                         r"data-parallel shards \(data\*fsdp\)$"):
        sharding.validate_batch(6, mesh, "config.ppo.batch_size")
    with pytest.raises(ValueError, match=r"config\.sft\.batch_size=0 must be a positive int"):
        sharding.validate_batch(0, mesh, "config.sft.batch_size")


@pytest.mark.parametrize("mesh_shape, logical, shape, expected", [
    ((1, 4, 2), ("embed", "mlp"), (8, 16), P("fsdp", "tensor")),
    ((1, 4, 2), ("mlp", "embed"), (16, 8), P("tensor", "fsdp")),
    ((1, 4, 2), ("vocab", "embed"), (6, 8), P("tensor", "fsdp")),
    # A tiny vocabulary (5) is not divisible by tensor=2: replicated along that dimension.
    ((1, 4, 2), ("vocab", "embed"), (5, 8), P(None, "fsdp")),
    ((1, 4, 2), ("embed", "heads", "head_dim"), (8, 4, 3), P("fsdp", "tensor", None)),
    # kv_heads=2 on tensor=4 falls back to replication; heads=8 stays sharded.
    ((1, 2, 4), ("embed", "kv_heads", "head_dim"), (8, 2, 4), P("fsdp", None, None)),
    ((1, 2, 4), ("embed", "heads", "head_dim"), (8, 8, 4), P("fsdp", "tensor", None)),
    ((1, 4, 2), ("norm",), (8,), P(None)),
    ((1, 4, 2), ("embed",), (6,), P(None)),
    # The same mesh axis is never used twice in one spec.
    ((1, 4, 2), ("heads", "mlp"), (4, 4), P("tensor", None)),
    ((2, 2, 2), ("activation_batch", "activation_length", "activation_vocab"), (8, 3, 6),
     P(("data", "fsdp"), None, "tensor")),
    # Batch 2 splits over data=2 but not over data*fsdp=4: the longest dividing prefix is kept.
    ((2, 2, 2), ("activation_batch", "activation_mlp"), (2, 16), P("data", "tensor")),
    ((2, 2, 2), ("activation_batch", "activation_kv_heads"), (3, 3), P(None, None)),
    ((1, 4, 2), (None, "mlp"), (3, 16), P(None, "tensor")),
])
def test_logical_rules_with_divisibility_fallback(mesh_shape, logical, shape, expected):
    mesh = _mesh(*mesh_shape)
    assert sharding.logical_to_mesh_spec(P(*logical), mesh, shape) == expected
    array = jax.device_put(jnp.zeros(shape), NamedSharding(mesh, expected))
    assert array.sharding.spec == expected


def test_logical_spec_without_shapes_uses_the_plain_rules():
    mesh = _mesh(1, 4, 2)
    assert sharding.logical_to_mesh_spec(P("vocab", "embed"), mesh) == P("tensor", "fsdp")
    assert sharding.logical_to_mesh_spec(P("activation_batch"), mesh) == P(("data", "fsdp"))


def test_logical_errors():
    mesh = _mesh(1, 4, 2)
    with pytest.raises(ValueError, match="logical axis name 'experts' has no rule"):
        sharding.logical_to_mesh_spec(P("experts", "embed"), mesh, (2, 8))
    with pytest.raises(ValueError, match=r"has 2 entries for an array of shape \(8,\)"):
        sharding.logical_to_mesh_spec(P("embed", "mlp"), mesh, (8,))
    with pytest.raises(ValueError, match="names mesh axis 'model'"):
        sharding.logical_to_mesh_spec(P("embed"), mesh, (8,), rules=(("embed", "model"),))


def test_logical_to_sharding_tree_and_shapes_structure():
    mesh = _mesh(1, 4, 2)
    logical = {"a": P("embed", "mlp"), "b": P("vocab"), "c": P()}
    shapes = {"a": jax.ShapeDtypeStruct((8, 4), jnp.float32), "b": np.zeros(3), "c": jnp.zeros(())}
    out = sharding.logical_to_sharding(logical, mesh, shapes=shapes)
    assert out == {"a": NamedSharding(mesh, P("fsdp", "tensor")),
                   "b": NamedSharding(mesh, P(None)), "c": NamedSharding(mesh, P())}
    with pytest.raises(ValueError, match="shapes does not match the structure"):
        sharding.logical_to_sharding(logical, mesh, shapes={"a": shapes["a"]})


def test_logical_rules_drop_axes_that_do_not_divide_known_sizes():
    mesh = _mesh(1, 2, 4)
    rules = dict(sharding.logical_rules(mesh, dims={"kv_heads": 2, "heads": 8, "vocab": 10,
                                                    "activation_batch": 2}))
    assert rules["kv_heads"] is None and rules["activation_kv_heads"] is None
    assert rules["heads"] == "tensor" and rules["activation_heads"] == "tensor"
    assert rules["vocab"] is None and rules["activation_vocab"] is None
    assert rules["activation_batch"] == ("data", "fsdp")
    assert rules["mlp"] == "tensor" and rules["embed"] == "fsdp"
    rules = dict(sharding.logical_rules(mesh, dims={"activation_batch": 1}))
    assert rules["activation_batch"] == "data"


def test_mesh_context_turns_logical_constraints_into_shardings():
    mesh = _mesh(2, 2, 2)

    @jax.jit
    def constrain(x):
        return nn.with_logical_constraint(x * 2.0, ("activation_batch", "activation_kv_heads"))

    x = jnp.arange(32.0).reshape(8, 4)
    with sharding.mesh_context(mesh):
        out = constrain(x)
    assert out.sharding == NamedSharding(mesh, P(("data", "fsdp"), "tensor"))
    np.testing.assert_array_equal(out, 2.0 * x)
    assert {s.data.shape for s in out.addressable_shards} == {(2, 2)}

    with sharding.mesh_context(mesh, sharding.logical_rules(mesh, dims={"kv_heads": 1})):
        out = jax.jit(lambda x: nn.with_logical_constraint(
            x + 1.0, ("activation_batch", "activation_kv_heads")))(x)
    assert out.sharding.spec in (P(("data", "fsdp"), None), P(("data", "fsdp")))

    plain = constrain(x)  # outside the context the constraint is a no-op
    assert len(plain.sharding.device_set) == 1


def test_batch_sharding_and_replicated():
    mesh = _mesh(2, 2, 2)
    batch = sharding.shard_pytree({"ids": np.arange(24).reshape(8, 3), "mask": np.ones(8)},
                                  sharding.batch_sharding(mesh))
    assert batch["ids"].sharding.spec == P(("data", "fsdp"))
    assert {s.data.shape for s in batch["ids"].addressable_shards} == {(2, 3)}
    # Shards along tensor hold the same rows.
    rows = {s.device.id: s.data[:, 0].tolist() for s in batch["ids"].addressable_shards}
    assert sorted(map(tuple, rows.values())) == sorted([(0, 3)] * 2 + [(6, 9)] * 2 + [(12, 15)] * 2
                                                       + [(18, 21)] * 2)
    local = sharding.shard_batch({"ids": np.arange(24).reshape(8, 3)}, mesh)
    assert local["ids"].sharding == sharding.batch_sharding(mesh)
    np.testing.assert_array_equal(local["ids"], np.arange(24).reshape(8, 3))
    r = sharding.shard_pytree(np.arange(4.0), sharding.replicated(mesh))
    assert all(s.data.shape == (4,) for s in r.addressable_shards) and len(r.addressable_shards) == 8


def test_opt_state_shardings_mirror_params_and_replicate_the_rest():
    mesh = _mesh(1, 4, 2)
    params = {"dense": {"kernel": jnp.zeros((8, 16)), "bias": jnp.zeros(16)}, "scale": jnp.zeros(8)}
    logical = {"dense": {"kernel": P("embed", "mlp"), "bias": P("mlp")}, "scale": P("norm")}
    param_shardings = sharding.logical_to_sharding(logical, mesh, shapes=params)
    shardings = sharding.opt_state_shardings(util.make_optimizer(), param_shardings, mesh,
                                             params=params)
    adam = shardings[1][0]
    assert adam.mu == param_shardings and adam.nu == param_shardings
    assert adam.count == sharding.replicated(mesh)
    state = jax.jit(util.make_optimizer().init, out_shardings=shardings)(params)
    assert state[1][0].mu["dense"]["kernel"].sharding.spec == P("fsdp", "tensor")

    factored = optax.adafactor(1e-3, min_dim_size_to_factor=4)
    shardings = sharding.opt_state_shardings(factored, param_shardings, mesh, params=params)
    by_path = {jax.tree_util.keystr(p): s for p, s in jax.tree.flatten_with_path(shardings)[0]}
    row_stats = [s for p, s in by_path.items() if "v_row" in p and "kernel" in p]
    assert row_stats == [sharding.replicated(mesh)]  # shape (8,) != kernel (8, 16)


@pytest.fixture(scope="module")
def trained():
    """Two sharded train steps on fsdp=4 x tensor=2 and two single-device ones from the same init."""
    model, params, logical, ids = util.init_model()
    optimizer = util.make_optimizer()
    step_fn = util.make_train_step(model, optimizer)

    single = jax.devices()[0]
    ref_params, ref_state = jax.device_put((params, optimizer.init(params)), single)
    ref_step = jax.jit(step_fn)
    ref_losses = []
    for _ in range(2):
        ref_params, ref_state, loss = ref_step(ref_params, ref_state, jax.device_put(ids, single))
        ref_losses.append(float(loss))

    mesh = _mesh(1, 4, 2)
    param_shardings = sharding.logical_to_sharding(logical, mesh, shapes=params)
    opt_shardings = sharding.opt_state_shardings(optimizer, param_shardings, mesh, params=params)
    sharded_params = sharding.shard_pytree(params, param_shardings)
    sharded_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(sharded_params)
    step = jax.jit(step_fn,
                   in_shardings=(param_shardings, opt_shardings, sharding.batch_sharding(mesh)),
                   out_shardings=(param_shardings, opt_shardings, sharding.replicated(mesh)),
                   donate_argnums=(0, 1))
    first_params = sharded_params
    losses = []
    with sharding.mesh_context(mesh, sharding.logical_rules(mesh, dims={"vocab": util.VOCAB})):
        for _ in range(2):
            sharded_params, sharded_state, loss = step(
                sharded_params, sharded_state, sharding.shard_batch(ids, mesh))
            losses.append(float(loss))
    return dict(ref_params=ref_params, ref_state=ref_state, ref_losses=ref_losses,
                params=sharded_params, state=sharded_state, losses=losses,
                first_params=first_params, param_shardings=param_shardings)


def test_sharded_step_matches_single_device(trained):
    # A few float32 ulps of a loss near 7: the sharded program sums in another order.
    np.testing.assert_allclose(trained["losses"], trained["ref_losses"], rtol=1e-6, atol=0)
    assert trained["losses"][1] < trained["losses"][0]
    for got, want in zip(jax.tree.leaves(trained["params"]), jax.tree.leaves(trained["ref_params"])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)
    for got, want in zip(jax.tree.leaves(trained["state"]), jax.tree.leaves(trained["ref_state"])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)


def test_params_and_optimizer_state_are_actually_sharded(trained):
    params = trained["params"]
    expected = {
        "embedding": (P(None, "fsdp"), (util.VOCAB, util.EMBED // 4)),
        "Dense_0/kernel": (P("fsdp", "tensor"), (util.EMBED // 4, util.MLP // 2)),
        "Dense_0/bias": (P("tensor"), (util.MLP // 2,)),
        "Dense_1/kernel": (P("tensor", "fsdp"), (util.MLP // 2, util.EMBED // 4)),
        "Dense_1/bias": (P("fsdp"), (util.EMBED // 4,)),
    }
    flat = {"/".join(k.key for k in path): leaf
            for path, leaf in jax.tree.flatten_with_path(params)[0]}
    assert set(flat) == set(expected)
    for name, (spec, shard_shape) in expected.items():
        assert flat[name].sharding.spec == spec, name
        assert {s.data.shape for s in flat[name].addressable_shards} == {shard_shape}, name
        assert len(flat[name].addressable_shards) == 8
    mu = trained["state"][1][0].mu
    assert mu["Dense_0"]["kernel"].sharding.spec == P("fsdp", "tensor")
    assert trained["state"][1][0].count.sharding.spec == P()


def test_donated_inputs_are_consumed(trained):
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(trained["first_params"]))
