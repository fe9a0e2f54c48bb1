"""A small GPT in the shape of Karpathy's nanoGPT: token and position
embeddings, pre-LayerNorm transformer blocks (causal self-attention through
scaled_dot_product_attention, a GELU MLP, dropout, residuals), a final
LayerNorm and a language-model head whose weight is tied to the token
embedding (tie=False unties it). Used by the capture-time and step
benchmarks: the blocks are what users graph; `step_parts` splits a GPT into
the layers and loss of a training step (make_graphed_step)."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd, dropout):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab=512, block_size=256, n_layer=6, n_head=6, n_embd=384, dropout=0.0, tie=True):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx, targets):
        x = embed(self, idx)
        for b in self.blocks:
            x = b(x)
        return head(self, x, targets)


def embed(m, idx):
    """Token plus position embeddings, then dropout (`m` has wte, wpe, drop)."""
    pos = torch.arange(idx.shape[1], device=idx.device)
    return m.drop(m.wte(idx) + m.wpe(pos))


def head(m, x, targets):
    """The final LayerNorm, the LM head, and cross-entropy in fp32 (`m` has
    ln_f, lm_head)."""
    logits = m.lm_head(m.ln_f(x))
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


class Embed(nn.Module):
    """A GPT's embeddings as a layer of its own (token ids in, activations out)."""

    def __init__(self, gpt):
        super().__init__()
        self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop

    def forward(self, idx):
        return embed(self, idx)


class Head(nn.Module):
    """A GPT's final LayerNorm, LM head and cross-entropy: a step's loss
    (activations and targets in, the mean loss out)."""

    def __init__(self, gpt):
        super().__init__()
        self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x, targets):
        return head(self, x, targets)


def step_parts(gpt):
    """(the layers, the loss) of a training step over `gpt`: its embeddings
    and blocks in order, then the head with its loss; the modules share the
    GPT's parameters."""
    return [Embed(gpt), *gpt.blocks], Head(gpt)
