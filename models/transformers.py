"""Small transformers for tests and benchmarks, with heads and FFN neurons as named groups.

Attention is written out the way the torch exporters see HuggingFace-style code: Linear
projections, view to [B, T, H, d], transpose, matmul, softmax, matmul, transpose back, view to
[B, T, H * d], output Linear. A head is a group channel owning head_dim rows of Q, K and V
(and their biases) and head_dim columns of the output projection; with grouped-query
attention a K/V head owns its query heads too, and a query "rank" r owns query head
j * n_rep + r of every K/V group j. FFN neurons own a row of the up (and gate) projection and a
column of the down projection. Hidden size is not a group: LayerNorm/RMSNorm see all of it.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from models.zoo import Entry, Grouped


def _rows(d: int):
    return lambda i: np.arange(i * d, (i + 1) * d)


class Attention(nn.Module):
    def __init__(
        self,
        owner: Grouped,
        p: str,
        d_model: int,
        head_dim: int,
        *,
        bias: bool = True,
        fused: bool = False,
        rotary: bool = False,
        causal: bool = False,
        gqa: bool = False,
        heads_literal: bool = True,
        max_len: int = 32,
    ):
        super().__init__()
        d = head_dim
        if gqa:
            kv, rep = owner.w(f"{p}.kv"), owner.w(f"{p}.rep")
            heads = kv * rep
        else:
            kv = heads = owner.w(f"{p}.heads")
            rep = 1
        self.d, self.heads, self.kv, self.rep = d, heads, kv, rep
        self.fused, self.rotary, self.causal, self.heads_literal = (
            fused,
            rotary,
            causal,
            heads_literal,
        )
        if fused:
            self.qkv = nn.Linear(d_model, 3 * heads * d, bias=bias)
        else:
            self.q = nn.Linear(d_model, heads * d, bias=bias)
            self.k = nn.Linear(d_model, kv * d, bias=bias)
            self.v = nn.Linear(d_model, kv * d, bias=bias)
        self.o = nn.Linear(heads * d, d_model, bias=bias)
        if causal:
            self.register_buffer(
                "mask",
                torch.triu(torch.full((max_len, max_len), float("-inf")), 1),
                persistent=False,
            )
        if rotary:
            inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
            angles = torch.outer(torch.arange(max_len).float(), inv)
            self.register_buffer("cos", torch.cat([angles, angles], -1).cos(), persistent=False)
            self.register_buffer("sin", torch.cat([angles, angles], -1).sin(), persistent=False)
        params = ["weight", "bias"] if bias else ["weight"]
        if gqa:

            def qrows(heads_of):
                return lambda i: np.concatenate([_rows(d)(h) for h in heads_of(i)])

            def of_kv(j):  # the query heads K/V head j serves
                return [j * rep + r for r in range(rep)]

            def of_rep(r):  # query head r of every K/V group
                return [j * rep + r for j in range(kv)]

            for name in params:
                owner.claim(f"{p}.kv", self.k, name, 0, _rows(d))
                owner.claim(f"{p}.kv", self.v, name, 0, _rows(d))
                owner.claim(f"{p}.kv", self.q, name, 0, qrows(of_kv))
                owner.claim(f"{p}.rep", self.q, name, 0, qrows(of_rep))
            owner.claim(f"{p}.kv", self.o, "weight", 1, qrows(of_kv))
            owner.claim(f"{p}.rep", self.o, "weight", 1, qrows(of_rep))
        else:
            g = f"{p}.heads"
            for name in params:
                if fused:  # a head owns its rows in each of the q, k and v thirds
                    owner.claim(
                        g,
                        self.qkv,
                        name,
                        0,
                        lambda i: np.concatenate(
                            [
                                np.arange(s * heads * d + i * d, s * heads * d + (i + 1) * d)
                                for s in range(3)
                            ]
                        ),
                    )
                else:
                    for lin in (self.q, self.k, self.v):
                        owner.claim(g, lin, name, 0, _rows(d))
            owner.claim(g, self.o, "weight", 1, _rows(d))

    def _rope(self, x, t):
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * self.cos[:t] + rotated * self.sin[:t]

    def forward(self, x, bias=None):
        b, t, _ = x.shape
        h = self.heads if self.heads_literal else -1
        if self.fused:
            q, k, v = self.qkv(x).split(self.heads * self.d, dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q = q.view(b, t, h, self.d).transpose(1, 2)
        k = k.view(b, t, self.kv if self.heads_literal else -1, self.d).transpose(1, 2)
        v = v.view(b, t, self.kv if self.heads_literal else -1, self.d).transpose(1, 2)
        if self.rotary:
            q, k = self._rope(q, t), self._rope(k, t)
        if self.rep > 1:  # grouped-query attention: each K/V head serves `rep` query heads
            k = (
                k[:, :, None]
                .expand(b, self.kv, self.rep, t, self.d)
                .reshape(b, self.heads, t, self.d)
            )
            v = (
                v[:, :, None]
                .expand(b, self.kv, self.rep, t, self.d)
                .reshape(b, self.heads, t, self.d)
            )
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d)
        if self.causal:
            scores = scores + self.mask[:t, :t]
        if bias is not None:
            scores = scores + bias
        ctx = (scores.softmax(-1) @ v).transpose(1, 2)
        ctx = (
            ctx.reshape(b, t, self.heads * self.d) if self.heads_literal else ctx.reshape(b, t, -1)
        )
        return self.o(ctx)


class MLP(nn.Module):
    def __init__(
        self, owner: Grouped, group: str, d_model: int, act: str = "gelu", bias: bool = True
    ):
        super().__init__()
        f = owner.w(group)
        self.act = act
        self.up = nn.Linear(d_model, f, bias=bias)
        self.down = nn.Linear(f, d_model, bias=bias)
        if act == "swiglu":
            self.gate = nn.Linear(d_model, f, bias=bias)
            owner.produce(group, self.gate)
        owner.produce(group, self.up)
        owner.claim(group, self.down, "weight", 1, lambda i: np.array([i]))

    def forward(self, x):
        if self.act == "swiglu":
            return self.down(nn.functional.silu(self.gate(x)) * self.up(x))
        h = self.up(x)
        return self.down(nn.functional.gelu(h) if self.act == "gelu" else torch.relu(h))


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    def __init__(
        self,
        owner: Grouped,
        i: int,
        d_model: int,
        head_dim: int,
        *,
        pre_ln: bool,
        norm: str = "layer",
        act: str = "gelu",
        bias: bool = True,
        **attn,
    ):
        super().__init__()
        make = (lambda: nn.LayerNorm(d_model)) if norm == "layer" else (lambda: RMSNorm(d_model))
        self.n1, self.n2 = make(), make()
        self.attn = Attention(owner, f"l{i}", d_model, head_dim, bias=bias, **attn)
        self.mlp = MLP(owner, f"l{i}.ffn", d_model, act, bias)
        self.pre_ln = pre_ln

    def forward(self, x, bias=None):
        if self.pre_ln:
            x = x + self.attn(self.n1(x), bias)
            return x + self.mlp(self.n2(x))
        x = self.n1(x + self.attn(x, bias))
        return self.n2(x + self.mlp(x))


class Transformer(Grouped):
    """`kind`: bert (post-LN encoder, attention-mask input), vit (patch conv, pre-LN), gpt
    (causal decoder, fused QKV) or llama (RMSNorm, rotary, grouped-query attention, SwiGLU)."""

    def __init__(
        self,
        widths: dict[str, int] | None = None,
        *,
        kind: str = "bert",
        layers: int = 2,
        d_model: int = 32,
        heads: int = 4,
        kv_heads: int = 2,
        ffn: int = 64,
        vocab: int = 50,
        max_len: int = 32,
    ):
        head_dim = d_model // heads
        gqa = kind == "llama"
        defaults: dict[str, int] = {}
        for i in range(layers):
            if gqa:
                defaults |= {f"l{i}.kv": kv_heads, f"l{i}.rep": heads // kv_heads}
            else:
                defaults[f"l{i}.heads"] = heads
            defaults[f"l{i}.ffn"] = ffn
        super().__init__(widths or {}, defaults)
        self.kind = kind
        attn = {
            "bert": dict(pre_ln=False, heads_literal=True),
            "vit": dict(pre_ln=True, heads_literal=False),
            "gpt": dict(pre_ln=True, fused=True, causal=True, heads_literal=False),
            "llama": dict(
                pre_ln=True,
                norm="rms",
                act="swiglu",
                bias=False,
                rotary=True,
                causal=True,
                gqa=True,
            ),
        }[kind]
        if kind == "vit":
            self.patch = nn.Conv2d(3, d_model, 4, 4)
            self.cls = nn.Parameter(torch.zeros(1, 1, d_model))
            self.pos = nn.Parameter(torch.zeros(1, 17, d_model))
        else:
            self.tok = nn.Embedding(vocab, d_model)
            if kind in ("bert", "gpt"):
                self.pos = nn.Embedding(max_len, d_model)
        if kind == "bert":
            self.emb_norm = nn.LayerNorm(d_model)
        self.blocks = nn.ModuleList(
            [Block(self, i, d_model, head_dim, max_len=max_len, **attn) for i in range(layers)]
        )
        if kind != "bert":
            self.final = nn.LayerNorm(d_model) if kind != "llama" else RMSNorm(d_model)
        self.head = nn.Linear(d_model, 3 if kind in ("bert", "vit") else vocab)

    def forward(self, x, attention_mask=None):
        bias = None
        if self.kind == "vit":
            p = self.patch(x).flatten(2).transpose(1, 2)
            h = torch.cat([self.cls.expand(p.shape[0], -1, -1), p], 1) + self.pos
        else:
            t = x.shape[1]
            h = self.tok(x)
            if self.kind in ("bert", "gpt"):
                h = h + self.pos(torch.arange(t))
            if self.kind == "bert":
                h = self.emb_norm(h)
                bias = ((1.0 - attention_mask) * -10000.0)[:, None, None, :]
        for block in self.blocks:
            h = block(h, bias)
        if self.kind != "bert":
            h = self.final(h)
        return self.head(h[:, 0] if self.kind in ("bert", "vit") else h)


class BagOfEmbeddings(nn.Module):
    """Token embeddings averaged over the sequence, then a Linear: the EmbeddingBag -> Linear
    form whose table a data sparsifier masks by columns (features) or rows (tokens)."""

    def __init__(self, vocab: int = 50, dim: int = 16, classes: int = 4):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        return self.head(self.tok(x).mean(1))


def _ids(batch: int = 1, seq: int = 8, vocab: int = 50):
    return (torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0)),)


TRANSFORMERS: dict[str, Entry] = {
    "bert": Entry(
        lambda w=None: Transformer(w, kind="bert"),
        (1, 8),
        lambda: (*_ids(), torch.tensor([[1.0] * 6 + [0.0] * 2])),
    ),
    "vit": Entry(lambda w=None: Transformer(w, kind="vit"), (1, 3, 16, 16)),
    "gpt": Entry(lambda w=None: Transformer(w, kind="gpt"), (1, 8), _ids),
    "llama": Entry(lambda w=None: Transformer(w, kind="llama", heads=4, kv_heads=2), (1, 8), _ids),
}
