"""A tiny logically-partitioned language model and its train step, shared by the sharding and
checkpoint tests."""
import flax.linen as nn
import jax
import optax

VOCAB = 5  # not divisible by tensor=2: the vocab dimension must fall back to replication
EMBED = 8
MLP = 16


class TinyLM(nn.Module):
    """Tied-embedding MLP language model: ids [B, T] -> logits [B, T, VOCAB]."""

    @nn.compact
    def __call__(self, ids):
        embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed")),
            (VOCAB, EMBED))
        x = nn.with_logical_constraint(
            embedding[ids], ("activation_batch", "activation_length", "activation_embed"))
        h = nn.Dense(
            MLP,
            kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")),
            bias_init=nn.with_logical_partitioning(nn.initializers.normal(0.1), ("mlp",)))(x)
        h = nn.with_logical_constraint(
            nn.gelu(h), ("activation_batch", "activation_length", "activation_mlp"))
        out = nn.Dense(
            EMBED,
            kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed")),
            bias_init=nn.with_logical_partitioning(nn.initializers.normal(0.1), ("embed",)))(h)
        return (x + out) @ embedding.T


def init_model(seed=0, batch=8, length=6):
    """Returns (model, params (plain arrays), logical specs, ids [batch, length])."""
    model = TinyLM()
    ids = jax.random.randint(jax.random.key(seed + 1), (batch, length), 0, VOCAB)
    variables = model.init(jax.random.key(seed), ids)
    logical = nn.get_partition_spec(variables)["params"]
    params = nn.unbox(variables)["params"]
    return model, params, logical, ids


def make_optimizer():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))


def make_train_step(model, optimizer):
    def loss_fn(params, ids):
        logits = model.apply({"params": params}, ids[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    def train_step(params, opt_state, ids):
        loss, grads = jax.value_and_grad(loss_fn)(params, ids)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step

