"""Plain torch modules for the GPU tests (the scenarios of Transformer
Engine's CUDA-graph tests that need no Transformer Engine), and the training
loop they are compared with eagerly."""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

SEQ, BATCH, HEADS, HEAD_DIM = 32, 2, 2, 32
HIDDEN = HEADS * HEAD_DIM


class Attention(nn.Module):
    """Self-attention over (seq, batch, hidden) with scaled_dot_product_attention;
    an optional boolean mask (batch, 1, seq, seq) and a fixed scale."""

    def __init__(self, dtype, unused=False):
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, device="cuda", dtype=dtype)
        self.proj = nn.Linear(HIDDEN, HIDDEN, device="cuda", dtype=dtype)
        # A parameter the forward never uses: it gets no grad (allow_unused_input).
        self.unused = nn.Linear(HIDDEN, HIDDEN, device="cuda", dtype=dtype) if unused else None

    def forward(self, x, attention_mask=None, scale=None):
        s, b, _ = x.shape
        q, k, v = self.qkv(x).view(s, b, 3, HEADS, HEAD_DIM).permute(2, 1, 3, 0, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=scale)
        return self.proj(y.permute(2, 0, 1, 3).reshape(s, b, HIDDEN))


class MHA(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.attn = nn.MultiheadAttention(HIDDEN, HEADS, dropout=0.0, device="cuda", dtype=dtype)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


class MLP(nn.Module):
    def __init__(self, dtype, checkpointed):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN, device="cuda", dtype=dtype)
        self.fc1 = nn.Linear(HIDDEN, 4 * HIDDEN, device="cuda", dtype=dtype)
        self.fc2 = nn.Linear(4 * HIDDEN, HIDDEN, device="cuda", dtype=dtype)
        self.checkpointed = checkpointed

    def body(self, x):
        return self.fc2(F.gelu(self.fc1(self.norm(x))))

    def forward(self, x):
        if self.checkpointed:
            # The generator state cannot be read under capture (as with torch's own graphs).
            return checkpoint(self.body, x, use_reentrant=False, preserve_rng_state=False)
        return self.body(x)


class SDPA(nn.Module):
    """Scaled-dot-product attention of three inputs (batch, heads, seq, dim)."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


def make_layer(kind, dtype):
    if kind == "linear":
        return nn.Linear(HIDDEN, HIDDEN, device="cuda", dtype=dtype)
    if kind == "layernorm_linear":
        return nn.Sequential(nn.LayerNorm(HIDDEN, device="cuda", dtype=dtype),
                             nn.Linear(HIDDEN, HIDDEN, device="cuda", dtype=dtype))
    if kind == "layernorm_mlp":
        return MLP(dtype, checkpointed=False)
    if kind == "layernorm_mlp_checkpoint":
        return MLP(dtype, checkpointed=True)
    if kind == "mha":
        return MHA(dtype)
    if kind == "transformer":
        return nn.TransformerEncoderLayer(HIDDEN, HEADS, dim_feedforward=4 * HIDDEN, dropout=0.0,
                                          device="cuda", dtype=dtype)
    if kind == "attention":
        return Attention(dtype)
    raise ValueError(kind)


def data(dtype, ones=False, requires_grad=True):
    make = torch.ones if ones else torch.randn
    return make(SEQ, BATCH, HIDDEN, device="cuda", dtype=dtype, requires_grad=requires_grad)


def outputs_of(model, output):
    """Parameters, their grads and the last output, for comparison."""
    values = []
    for p in model.parameters():
        values.append(p)
        if p.grad is not None:
            values.append(p.grad)
    values.extend(output if isinstance(output, (list, tuple)) else [output])
    return [v.detach().clone() for v in values]


def assert_all_equal(got, want):
    assert len(got) == len(want), f"{len(got)} tensors against {len(want)}"
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]
    if bad:
        i = bad[0]
        diff = (got[i].float() - want[i].float()).abs().max().item()
        raise AssertionError(f"tensors {bad} differ from eager (first: index {i}, max abs difference {diff})")


def deep(x):
    return copy.deepcopy(x)


class CausalBlock(nn.Module):
    """A causal pre-LayerNorm transformer block over (seq, batch, hidden):
    padding appended to the sequence is never attended by real tokens
    (the bucket tests, and benches/torch_varlen.py)."""

    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc, self.out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        t, b, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(t, b, 3, self.heads, h // self.heads).permute(2, 1, 3, 0, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.permute(2, 0, 1, 3).reshape(t, b, h))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))
