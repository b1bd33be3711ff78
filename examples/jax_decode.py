"""Decode a few steps of a small random JAX transformer over a paged KV cache, under
jax.jit, through cupaged.jax.

Each step is one jitted function: per layer a QKV projection, the new tokens' K and V
written into the layer's paged cache (cupaged.jax.reshape_and_cache, in place: the caches
are donated), paged attention over the cache (cupaged.jax.attention) and an MLP; then
greedy sampling. The steps run in a lax.fori_loop, so the whole generation is one XLA
program with no host round trip. Random weights, nothing downloaded; needs JAX with its
CUDA plugin, CuPy and a GPU:

    python examples/jax_decode.py --batch 4 --prompt-len 40 --steps 16
    XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,WHILE,CONDITIONAL \\
    --xla_gpu_graph_min_graph_size=1" python examples/jax_decode.py --command-buffer

The prompt's K and V are written by one cache write of all its tokens (no prefill
attention: this is about the decode loop).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import cupaged.jax as cj  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=40)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--command-buffer", action="store_true",
                   help="let XLA record the cupaged calls into its command buffers")
    return p.parse_args()


def init(args, key):
    d = args.heads * args.head_size
    kvd = args.kv_heads * args.head_size
    keys = iter(jax.random.split(key, 4 * args.layers + 2))

    def w(shape):
        return (jax.random.normal(next(keys), shape, jnp.float32) / np.sqrt(shape[0])).astype(
            jnp.bfloat16)

    layers = [dict(qkv=w((d, d + 2 * kvd)), o=w((d, d)), up=w((d, 4 * d)), down=w((4 * d, d)))
              for _ in range(args.layers)]
    return dict(embed=w((args.vocab, d)), layers=layers, head=w((d, args.vocab)))


def rms(x):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype)


def forward(params, tokens, caches, block_tables, seq_lens, slots, args, max_seq_len):
    """One decode token per sequence: logits, and the caches with its K and V written."""
    b, hs = tokens.shape[0], args.head_size
    h = params["embed"][tokens]
    new = []
    for layer, (kc, vc) in zip(params["layers"], caches):
        qkv = rms(h) @ layer["qkv"]
        q = qkv[:, :args.heads * hs].reshape(b, args.heads, hs)
        k, v = (qkv[:, args.heads * hs:].reshape(b, 2, args.kv_heads, hs)[:, i]
                for i in range(2))
        kc, vc = cj.reshape_and_cache(k, v, kc, vc, slots, kv_layout="NHD",
                                      command_buffer=args.command_buffer)
        att = cj.attention(q, kc, vc, block_tables, seq_lens, max_seq_len=max_seq_len,
                           command_buffer=args.command_buffer)
        h = h + att.reshape(b, -1) @ layer["o"]
        h = h + jax.nn.gelu(rms(h) @ layer["up"]) @ layer["down"]
        new.append((kc, vc))
    return (rms(h) @ params["head"]).astype(jnp.float32), new


def main():
    args = parse_args()
    if not any(d.platform == "gpu" for d in jax.devices()):
        raise SystemExit("JAX sees no GPU: cupaged.jax needs JAX's CUDA plugin")
    rng = np.random.default_rng(0)
    bs, total = args.block_size, args.prompt_len + args.steps
    blocks_per_seq = -(-total // bs)
    num_blocks = args.batch * blocks_per_seq + 1
    # Each sequence its own blocks, in a shuffled order (block 0 unused).
    perm = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
    block_tables = jnp.asarray(perm.reshape(args.batch, blocks_per_seq))
    max_seq_len = blocks_per_seq * bs
    shape = (num_blocks, bs, args.kv_heads, args.head_size)
    caches = [(jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16))
              for _ in range(args.layers)]
    params = init(args, jax.random.PRNGKey(0))

    def slots_at(pos):  # each sequence's cache slot at position pos [batch]
        return block_tables[jnp.arange(args.batch), pos // bs] * bs + pos % bs

    # The prompt's K and V: random here, written in one call per layer.
    prompt_pos = jnp.tile(jnp.arange(args.prompt_len), args.batch)
    prompt_slots = (block_tables[jnp.repeat(jnp.arange(args.batch), args.prompt_len),
                                 prompt_pos // bs] * bs + prompt_pos % bs)
    n = args.batch * args.prompt_len
    filled = []
    for kc, vc in caches:
        k, v = (jax.random.normal(jax.random.PRNGKey(i), (n, args.kv_heads, args.head_size),
                                  jnp.bfloat16) for i in (1, 2))
        filled.append(cj.reshape_and_cache(k, v, kc, vc, prompt_slots, kv_layout="NHD"))
    caches = filled

    @jax.jit
    def generate(params, caches, first):
        def step(i, carry):
            tokens, caches, out = carry
            pos = jnp.full((args.batch,), args.prompt_len, jnp.int32) + i
            logits, caches = forward(params, tokens, caches, block_tables, pos + 1,
                                     slots_at(pos), args, max_seq_len)
            tokens = jnp.argmax(logits, -1).astype(jnp.int32)
            return tokens, caches, out.at[:, i].set(tokens)

        out = jnp.zeros((args.batch, args.steps), jnp.int32)
        return jax.lax.fori_loop(0, args.steps, step, (first, caches, out))

    generate = jax.jit(generate.__wrapped__, donate_argnums=(1,))
    first = jnp.asarray(rng.integers(0, args.vocab, args.batch).astype(np.int32))
    t = time.perf_counter()
    compiled = generate.lower(params, caches, first).compile()
    print(f"traced and compiled in {time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    _, caches, tokens = compiled(params, caches, first)
    tokens = np.asarray(tokens)
    dt = time.perf_counter() - t
    print(f"{args.steps} steps of {args.batch} sequences x {args.layers} layers in "
          f"{dt * 1e3:.1f} ms ({dt / args.steps * 1e3:.2f} ms a step)")
    for b in range(args.batch):
        print(f"sequence {b}: {tokens[b].tolist()}")


if __name__ == "__main__":
    main()
