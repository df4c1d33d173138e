"""The model the Python tests train: a small GPT-style transformer, in plain torch.

    tokens -> embedding + position -> LAYERS x Block -> LayerNorm -> LM head -> cross-entropy

    Block(x):  h = LayerNorm(x); q, k, v = split(Linear(h)); causal softmax attention
               x = x + Linear(attention)          # residual: norm1 saved x for backward,
               h = Linear(LayerNorm(x)); h.relu_()  # and x is still referenced here
               x = x + Linear(h)                  # in place: relu_ saves its result, the
                                                  # same storage fc2 saves

Explicit attention (torch 1.13 has no scaled_dot_product_attention), no dropout, fp32: on
the CPU with one thread every op is deterministic, so a run under vramswap can be compared
bit for bit with a run without it.

The sizes keep compute small and saved blocks large: with width 64 and 8192 tokens an
activation is 2 MiB (one granule of cudasim's VMM, so tagged blocks waste no page), an
attention probability map 16 MiB, so saved activations dominate the step's memory.

`probe`, when set, is called as probe(name, tensor) right before each residual add, with the
residual input: a tensor autograd saved for backward (LayerNorm saves its input) that the
forward still references — vramswap must never evict it at that point.
"""

LAYERS, WIDTH, HEADS, FFN, VOCAB, SEQ, BATCH = 4, 64, 4, 128, 256, 64, 128


def build(torch, layers=LAYERS, width=WIDTH, heads=HEADS, ffn=FFN, vocab=VOCAB, seq=SEQ,
          batch=BATCH, microbatches=1, seed=0):
    """-> (model, [(tokens, targets)] * microbatches), the same for a given seed."""
    nn = torch.nn
    F = torch.nn.functional
    torch.manual_seed(seed)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = nn.LayerNorm(width)
            self.qkv = nn.Linear(width, 3 * width)
            self.proj = nn.Linear(width, width)
            self.norm2 = nn.LayerNorm(width)
            self.fc1 = nn.Linear(width, ffn)
            self.fc2 = nn.Linear(ffn, width)
            self.probe = None

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in (q, k, v))
            scores = (q @ k.transpose(-2, -1)) * (c // heads) ** -0.5
            mask = torch.ones(t, t, dtype=torch.bool).triu(1)
            att = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
            y = (att @ v).transpose(1, 2).reshape(b, t, c)
            if self.probe:
                self.probe("attention residual", x)
            x = x + self.proj(y)
            h = self.fc1(self.norm2(x))
            h.relu_()
            if self.probe:
                self.probe("mlp residual", x)
            return x + self.fc2(h)

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.pos = nn.Parameter(torch.randn(seq, width) * 0.02)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab)

        def set_probe(self, probe):
            for block in self.blocks:
                block.probe = probe

        def forward(self, tokens, targets, run_block=None):
            """run_block(block, x) -> x runs one block (default: block(x)); the checkpoint
            case passes torch.utils.checkpoint here."""
            x = self.embed(tokens) + self.pos
            for block in self.blocks:
                x = run_block(block, x) if run_block else block(x)
            logits = self.head(self.norm(x))
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    model = GPT()
    data = [(torch.randint(vocab, (batch, seq)), torch.randint(vocab, (batch, seq)))
            for _ in range(microbatches)]
    return model, data


def gradients(model):
    """name -> gradient, for every parameter (None where it has none)."""
    return {name: p.grad for name, p in model.named_parameters()}
