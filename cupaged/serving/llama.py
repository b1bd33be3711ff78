"""A Llama-architecture decoder in plain PyTorch, with random weights, for end-to-end runs.

:class:`Llama` computes a flat batch of tokens (chunks of several sequences packed one
after another) and leaves attention to the caller: each layer calls
``attention(layer, q, k, v)``, so the same model runs over cupaged's paged cache (the
serving loop in :mod:`cupaged.serving.engine`), over :class:`DenseAttention`, a dense reference
for CPU tests, or over :class:`SdpaAttention` (contiguous K/V, torch SDPA: the baseline of
``cupaged-bench e2e``). Its weights are random (from a seed, on any device and dtype: nothing is
downloaded) and carry Hugging Face's parameter names, so :func:`to_hf` builds
``transformers.LlamaForCausalLM`` with exactly the same weights to check it against.

The architecture: RMSNorm, rotary position embeddings (RoPE, with Hugging Face's
``rotate_half`` convention), grouped-query attention, a SwiGLU MLP, and an optional tied
embedding. RoPE is plain: Llama 3's frequency scaling (``rope_type="llama3"``) is not
applied, so the presets have Llama 3's shapes but not its long-context positions.

torch is needed here (it is imported by this module, never by ``import cupaged``);
transformers only by :func:`to_hf`.
"""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass
from functools import partial
from itertools import chain
from typing import Callable, Hashable, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["DenseAttention", "Llama", "LlamaConfig", "SdpaAttention", "decoder_layer",
           "dense_attention", "to_hf"]

# Attention as the model calls it: (layer, q [T, num_heads, head_dim], k [T, num_kv_heads,
# head_dim], v [T, num_kv_heads, head_dim]) -> [T, num_heads, head_dim].
Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LlamaConfig:
    """Shapes and constants of a Llama decoder (Hugging Face's names in brackets where they
    differ: ``num_layers`` [num_hidden_layers], ``num_heads`` [num_attention_heads],
    ``num_kv_heads`` [num_key_value_heads])."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def preset(cls, name: str) -> "LlamaConfig":
        """``"llama-3.2-1b"``, ``"llama-3-8b"`` (those models' shapes) or ``"tiny"`` (for
        tests: 2 layers, hidden size 128, vocabulary 512)."""
        try:
            return _PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown preset {name!r}: expected one of {sorted(_PRESETS)}") from None

    @property
    def num_parameters(self) -> int:
        """Weights in the model (a tied head counted once)."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        layer = h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head


_PRESETS = {
    "llama-3.2-1b": LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                                rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "llama-3-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                              num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                              rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "tiny": LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10000.0,
                        rms_norm_eps=1e-5, tie_word_embeddings=False),
}


@dataclass
class _Layer:
    # Q, K and V projections stacked (one matmul), and gate over up: the Hugging Face
    # weights are row slices of these.
    qkv: torch.Tensor  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    o: torch.Tensor  # [hidden, num_heads * head_dim]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]
    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]


class Llama:
    """A Llama decoder with random weights: normal with standard deviation ``std`` for the
    embedding and every projection, ones for the norms (activations stay of order one
    through 32 layers), drawn from ``seed`` on ``device`` in ``dtype``.

    ``forward`` runs a flat batch; :meth:`state_dict_hf` gives the weights under Hugging
    Face's names (views, no copies).
    """

    def __init__(self, config: LlamaConfig, *, device="cpu", dtype=torch.float32, seed: int = 0,
                 std: float = 0.02):
        self.config = c = config
        self.device, self.dtype = torch.device(device), dtype
        gen = torch.Generator(device=self.device).manual_seed(seed)

        def normal(*shape):
            return torch.randn(shape, generator=gen, device=self.device, dtype=dtype).mul_(std)

        def ones(n):
            return torch.ones(n, device=self.device, dtype=dtype)

        h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.embed = normal(c.vocab_size, h)
        self.layers = [_Layer(normal(q + 2 * kv, h), normal(h, q),
                              normal(2 * c.intermediate_size, h), normal(h, c.intermediate_size),
                              ones(h), ones(h)) for _ in range(c.num_layers)]
        self.norm = ones(h)
        self.lm_head = self.embed if c.tie_word_embeddings else normal(c.vocab_size, h)
        # As Hugging Face computes it (on the CPU, in float32), so positions rotate alike.
        exponents = torch.arange(0, c.head_dim, 2, dtype=torch.int64).float() / c.head_dim
        self.inv_freq = (1.0 / (c.rope_theta ** exponents)).to(self.device)

    def state_dict_hf(self) -> dict:
        """The weights under ``transformers.LlamaForCausalLM``'s parameter names (views of
        this model's tensors; ``lm_head.weight`` is the embedding when tied)."""
        c = self.config
        q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        sd = {"model.embed_tokens.weight": self.embed}
        for i, w in enumerate(self.layers):
            p = f"model.layers.{i}."
            sd[p + "self_attn.q_proj.weight"] = w.qkv[:q]
            sd[p + "self_attn.k_proj.weight"] = w.qkv[q:q + kv]
            sd[p + "self_attn.v_proj.weight"] = w.qkv[q + kv:]
            sd[p + "self_attn.o_proj.weight"] = w.o
            sd[p + "mlp.gate_proj.weight"] = w.gate_up[:inter]
            sd[p + "mlp.up_proj.weight"] = w.gate_up[inter:]
            sd[p + "mlp.down_proj.weight"] = w.down
            sd[p + "input_layernorm.weight"] = w.input_norm
            sd[p + "post_attention_layernorm.weight"] = w.post_norm
        sd["model.norm.weight"] = self.norm
        sd["lm_head.weight"] = self.lm_head
        return sd

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attention: Attention,
                logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of a flat batch of ``T`` tokens.

        Args:
            tokens: int64 ``[T]`` token ids on the model's device: several sequences'
                chunks, one after another (the attention callable knows where each starts).
            positions: int64 ``[T]``: each token's position in its sequence (for RoPE).
            attention: called once per layer as ``attention(layer, q, k, v)`` with ``q``
                ``[T, num_heads, head_dim]`` and ``k``, ``v`` ``[T, num_kv_heads,
                head_dim]`` (RoPE applied to q and k; k and v may be strided views), in the
                model's dtype; returns ``[T, num_heads, head_dim]``.
            logits_rows: int64 indices into the ``T`` rows whose logits are wanted (the
                last token of each prompt, decodes); ``None``: all rows. Only these rows
                go through the final norm and the vocabulary projection.

        Returns: ``[len(logits_rows), vocab_size]`` logits in the model's dtype.
        """
        c = self.config
        compiled = self._compiled
        # inference_mode where it runs eagerly; no_grad around compiled layers (an
        # inference_mode-decorated compiled function failed in inductor, torch 2.13:
        # "Cannot set version_counter for inference tensor").
        with torch.inference_mode() if compiled is None else torch.no_grad():
            cos, sin = self._rope(positions)
            h = F.embedding(tokens, self.embed)
            for layer, w in enumerate(self.layers):
                if compiled is None:
                    h = decoder_layer(c, h, w, cos, sin, partial(attention, layer))
                else:  # one graph for every layer: the layer's arrays are its arguments
                    h = self._run_compiled(c, h, w, cos, sin, attention.layer(layer))
            if logits_rows is not None:
                h = h[logits_rows]
            return F.linear(_rms_norm(h, self.norm, c.rms_norm_eps), self.lm_head)

    def _run_compiled(self, c, h, w, cos, sin, attend):
        """The compiled layer; the eager one for a step whose shapes would need a graph
        past dynamo's recompile limit (sizes of 0 or 1 each get a graph of their own: a
        single token, sequence or table column), with a warning the first time. The
        failure comes at compile time, before the layer runs."""
        try:
            return self._compiled(c, h, w, cos, sin, attend)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            if not self._warned:
                import warnings

                warnings.warn("cupaged Llama.compiled(): dynamo's recompile limit is reached; "
                              "steps of new shapes run the layers eagerly (raise "
                              "torch._dynamo.config.recompile_limit to compile them too)",
                              RuntimeWarning, stacklevel=4)
                self._warned = True
            return decoder_layer(c, h, w, cos, sin, attend)

    __call__ = forward
    _compiled = None

    def compiled(self, **options) -> "Llama":
        """This model (the same weights, no copies) with each decoder layer run through
        ``torch.compile(decoder_layer, **options)``: one compiled graph serves every layer
        (weights, caches and step arrays are its arguments, so 32 layers compile once, not
        32 times). Each compiled model has its own function, so its graphs count toward
        dynamo's recompile limit alone; a step past that limit runs eagerly, with a
        warning. Its ``forward`` needs an ``attention`` with a ``layer(i)`` method
        returning the layer's ``attend(q, k, v)`` callable, whose arrays the graph takes
        as inputs, such as :class:`cupaged.serving.engine.OpsAttention` (attention through
        ``torch.ops.cupaged``: no graph break)."""
        model = copy.copy(self)
        # A function of its own: dynamo's graphs and recompile limit are per code object,
        # so each compiled model gets its own rather than sharing decoder_layer's.
        layer_fn = types.FunctionType(decoder_layer.__code__.replace(), decoder_layer.__globals__,
                                      decoder_layer.__name__)
        model._compiled = torch.compile(layer_fn, **options)
        model._warned = False
        return model

    def _rope(self, positions: torch.Tensor):
        """cos, sin ``[T, 1, head_dim]`` in the model's dtype (float32 angles, as HF)."""
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)


def decoder_layer(c: "LlamaConfig", h: torch.Tensor, w: "_Layer", cos: torch.Tensor,
                  sin: torch.Tensor, attend) -> torch.Tensor:
    """One decoder layer over hidden states ``h`` ``[T, hidden]``: norm, QKV projection,
    RoPE (``cos``, ``sin`` from :meth:`Llama._rope`), ``attend(q, k, v)``, output
    projection and residual, norm, SwiGLU MLP and residual."""
    t = h.shape[0]
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    x = _rms_norm(h, w.input_norm, c.rms_norm_eps)
    q, k, v = F.linear(x, w.qkv).split([q_size, kv_size, kv_size], dim=-1)
    q = _rotate(q.view(t, c.num_heads, c.head_dim), cos, sin)
    k = _rotate(k.view(t, c.num_kv_heads, c.head_dim), cos, sin)
    o = attend(q, k, v.view(t, c.num_kv_heads, c.head_dim))
    h = h + F.linear(o.reshape(t, q_size), w.o)
    x = _rms_norm(h, w.post_norm, c.rms_norm_eps)
    gate, up = F.linear(x, w.gate_up).chunk(2, dim=-1)
    return h + F.linear(F.silu(gate) * up, w.down)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # In float32, rounded back before the weight: Hugging Face's order, bit for bit.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``[T, heads, head_dim]`` with HF's rotate_half: the two halves of the head
    dimension are the pairs."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of one sequence's newest ``n`` tokens over all its ``L`` keys.

    ``q`` ``[n, num_heads, head_dim]`` are the last ``n`` of the ``L`` positions of ``k``,
    ``v`` ``[L, num_kv_heads, head_dim]`` (bottom-right aligned: query i sees keys up to
    position ``L - n + i``); GQA by repeating each KV head for its group. Scores and
    softmax in float32; returns ``[n, num_heads, head_dim]`` in q's dtype.
    """
    n, heads, dim = q.shape
    keys, group = k.shape[0], heads // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * dim ** -0.5
    pos = torch.arange(keys - n, keys, device=q.device)
    mask = torch.arange(keys, device=q.device)[None, :] > pos[:, None]
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vf).to(q.dtype)


class DenseAttention:
    """Reference attention over dense per-sequence K/V kept across forward calls (CPU
    tests, any device): an ``attention`` callable for :meth:`Llama.forward`.

    Before each forward, :meth:`begin` names the batch's sequences and how many query rows
    each has, in row order; a sequence not seen before starts empty, so its first rows are
    positions 0... Each layer call appends the rows' K/V to their sequences and attends
    causally over each sequence's whole history (chunked prefill and decode alike).
    """

    def __init__(self):
        self._kv: dict = {}  # (seq, layer) -> (K [L, kv, hd], V [L, kv, hd])
        self._batch: list = []

    def begin(self, seq_ids: Sequence[Hashable], num_tokens: Sequence[int]) -> None:
        if len(seq_ids) != len(num_tokens):
            raise ValueError(f"{len(seq_ids)} sequences but {len(num_tokens)} token counts")
        self._batch = list(zip(seq_ids, num_tokens))

    def context_len(self, seq_id) -> int:
        kv = self._kv.get((seq_id, 0))
        return 0 if kv is None else kv[0].shape[0]

    def fork(self, parent, child) -> None:
        for (s, layer), kv in list(self._kv.items()):
            if s == parent:
                self._kv[(child, layer)] = kv

    def free(self, seq_id) -> None:
        for key in [key for key in self._kv if key[0] == seq_id]:
            del self._kv[key]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if sum(n for _, n in self._batch) != q.shape[0]:
            raise ValueError(f"begin() named {sum(n for _, n in self._batch)} rows, the layer "
                             f"has {q.shape[0]}")
        out = torch.empty_like(q)
        start = 0
        for s, n in self._batch:
            rows = slice(start, start + n)
            old = self._kv.get((s, layer))
            keys = k[rows] if old is None else torch.cat((old[0], k[rows]))
            values = v[rows] if old is None else torch.cat((old[1], v[rows]))
            self._kv[(s, layer)] = (keys, values)
            if n:
                out[rows] = self._attend(q[rows], keys, values)
            start += n
        return out

    _attend = staticmethod(dense_attention)


# The SDPA backends of the torch baselines (SdpaAttention, and transformers' generate in
# cupaged-bench e2e): all but cuDNN's, see SdpaAttention.__call__.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class SdpaAttention(DenseAttention):
    """:class:`DenseAttention`'s contiguous per-sequence K/V (grown with ``torch.cat`` each
    call), attended with ``torch.nn.functional.scaled_dot_product_attention``, one call per
    sequence (GQA through ``enable_gqa``): a cache without pages, on any device. The
    "before" of a paged cache in ``cupaged-bench e2e``."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # Not cuDNN's SDPA, which torch prefers on Hopper: it builds an execution plan for
        # each new shape, and a per-sequence cache meets a new length at every step
        # (measured on an H100: 0.93 ms of host time per call, 10x the whole step's GPU
        # time). Flash and memory-efficient attention take any length as it comes.
        with sdpa_kernel(SDPA_BACKENDS):
            return super().__call__(layer, q, k, v)

    @staticmethod
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, keys = q.shape[0], k.shape[0]
        mask, causal = None, False
        if n == keys:  # a whole prompt: SDPA's causal mask (top-left) is the right one
            causal = n > 1
        elif n > 1:  # a chunk after cached tokens: bottom-right aligned, spelled out
            mask = torch.ones(n, keys, dtype=torch.bool, device=q.device).tril(keys - n)
        # [tokens, heads, head_dim] -> [1, heads, tokens, head_dim]: views, no copies.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=mask, is_causal=causal, enable_gqa=True)
        return out[0].transpose(0, 1)


def to_hf(model: Llama, *, share_weights: bool = False):
    """``transformers.LlamaForCausalLM`` (SDPA attention, in eval mode) with ``model``'s
    configuration and weights, on its device and dtype.

    By default it holds a copy of the weights: it is built on the CPU in float32 (it
    initializes its own weights first, which is slow for large models), then cast and
    moved. ``share_weights=True`` builds it on the meta device instead (no memory, no
    initialization) and makes its parameters ``model``'s own tensors: no second copy, any
    size, but writing to one model's weights changes the other's."""
    import transformers

    c = model.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings, hidden_act="silu", attention_bias=False,
        mlp_bias=False, max_position_embeddings=131072,
        # Random weights have no special tokens: generate() runs to max_new_tokens.
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
        attn_implementation="sdpa")
    if share_weights:
        with torch.device("meta"):
            hf = transformers.LlamaForCausalLM(hf_config)
        hf.load_state_dict(model.state_dict_hf(), strict=True, assign=True)
        # The RoPE frequencies are buffers outside the state dict, still on the meta
        # device: this model's (computed as Hugging Face does) on its device.
        rotary = hf.model.rotary_emb
        rotary.inv_freq, rotary.original_inv_freq = model.inv_freq.clone(), model.inv_freq.clone()
        left = [n for n, t in chain(hf.named_parameters(), hf.named_buffers()) if t.is_meta]
        if left:
            raise RuntimeError(f"to_hf(share_weights=True): left on the meta device: {left}")
        return hf.requires_grad_(False).eval()
    # Built on the CPU in float32, where Hugging Face computes its RoPE frequencies as this
    # model does; then only the parameters take the model's dtype (the frequencies stay
    # float32, as in a model loaded in that dtype).
    hf = transformers.LlamaForCausalLM(hf_config)
    for p in hf.parameters():
        p.data = p.data.to(model.dtype)
    hf.to(model.device)
    hf.load_state_dict(model.state_dict_hf(), strict=True)
    return hf.eval()
