"""The compatibility suite's models: each as a user builds it from the library's own config
with random weights (no hub download), small enough for CI, with a batch of random inputs.

Every transformer is 2 layers deep (the compiled Llama 4), resnet10t 4 stages of one block
each. The sizes (batches of 16 sequences of 128 tokens at width 128, of 32 images of 64x64)
keep saved activations most of a step's memory, so that a limit at 60% or 40% of the step's
peak can only be met by evicting them, and most saved tensors at 1 MiB or more, so that
evicting them frees whole 2 MiB granules of cudasim's VMM (Note [Small saved tensors under
torch 2.x] in tests/python/test_vramswap_run.py: a model saving only small tensors can run
out of memory at a few granules).

MODELS maps a name to (library, what it is, build): build(torch) -> (model, batch, loss)
where batch(step) returns the step's inputs (made from a generator seeded by the step, so
every run draws the same ones) and loss(model, inputs) runs the forward and returns the
loss, as a user's loop would.

The libraries are imported inside each build, so that a plain run imports only what its
model needs.
"""

VOCAB, SEQ, BATCH = 512, 128, 16
IMAGE, CLASSES = 64, 10


def _tokens(torch, step, batch=BATCH, seq=SEQ, vocab=VOCAB):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(vocab, (batch, seq), generator=g)


def _causal_lm(config_class, model_class, **config):
    def build(torch):
        cfg = config_class(vocab_size=VOCAB, **config)
        model = model_class(cfg)

        def batch(step):
            ids = _tokens(torch, step)
            return {"input_ids": ids, "labels": ids}

        return model, batch, lambda m, b: m(**b).loss
    return build


def llama(torch, layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM
    return _causal_lm(LlamaConfig, LlamaForCausalLM, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=SEQ)(torch)


def gpt2(torch):
    from transformers import GPT2Config, GPT2LMHeadModel
    return _causal_lm(GPT2Config, GPT2LMHeadModel, n_embd=128, n_layer=2, n_head=4,
                      n_positions=SEQ)(torch)


def qwen2(torch):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return _causal_lm(Qwen2Config, Qwen2ForCausalLM, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=SEQ)(torch)


def mistral(torch):
    from transformers import MistralConfig, MistralForCausalLM
    return _causal_lm(MistralConfig, MistralForCausalLM, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=SEQ, sliding_window=64)(torch)


def bert(torch):
    from transformers import BertConfig, BertForMaskedLM
    model = BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, intermediate_size=256,
                                       max_position_embeddings=SEQ))

    def batch(step):
        ids = _tokens(torch, step)
        g = torch.Generator().manual_seed(2000 + step)
        masked = torch.rand(ids.shape, generator=g) < 0.15
        return {"input_ids": ids.masked_fill(masked, 1), "labels": ids.masked_fill(~masked, -100)}

    return model, batch, lambda m, b: m(**b).loss


def t5(torch):
    from transformers import T5Config, T5ForConditionalGeneration
    model = T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=128, d_kv=32, d_ff=256,
                                                num_layers=2, num_decoder_layers=2, num_heads=4,
                                                decoder_start_token_id=0, pad_token_id=0))

    def batch(step):
        return {"input_ids": _tokens(torch, step), "labels": _tokens(torch, 3000 + step, seq=SEQ // 2)}

    return model, batch, lambda m, b: m(**b).loss


def _images(torch, step, batch=32):
    g = torch.Generator().manual_seed(4000 + step)
    return (torch.randn(batch, 3, IMAGE, IMAGE, generator=g),
            torch.randint(CLASSES, (batch,), generator=g))


def _classifier(torch, model):
    def batch(step):
        x, y = _images(torch, step)
        return {"x": x, "y": y}

    return model, batch, lambda m, b: torch.nn.functional.cross_entropy(m(b["x"]), b["y"])


def vit(torch):
    import timm
    return _classifier(torch, timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=IMAGE,
                                                patch_size=8, depth=2, num_classes=CLASSES))


def resnet(torch):
    import timm
    # resnet10t's layout at half its widths: at full width its parameters, gradients and
    # AdamW state (80 MiB) are more than 60% of a step's peak at this batch.
    return _classifier(torch, timm.create_model("resnet10t", pretrained=False, num_classes=CLASSES,
                                                channels=(32, 64, 128, 256)))


def lora(torch):
    """Llama with peft's LoRA adapters on its attention and MLP projections; the base frozen."""
    from peft import LoraConfig, get_peft_model
    model, batch, loss = llama(torch)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                             "gate_proj", "up_proj", "down_proj"]))
    return model, batch, loss


def compiled(torch):
    """Llama with each decoder layer compiled (torch.compile: inductor, C++ on the CPU), as
    torchtitan compiles a transformer: README, "Limits", torch.compile of a whole model.
    4 layers: a compiled layer's saved tensors reach the hooks only when the layer returns,
    so one layer's working set (about 40% of the step's peak with 2 layers) must fit beside
    everything else; in a real model it is a small part of the whole."""
    model, batch, loss = llama(torch, layers=4)
    for layer in model.model.layers:
        layer.compile()
    return model, batch, loss


MODELS = {
    "llama": ("transformers", "LlamaForCausalLM (GQA 4/2 heads, RoPE)", llama),
    "gpt2": ("transformers", "GPT2LMHeadModel", gpt2),
    "qwen2": ("transformers", "Qwen2ForCausalLM (GQA 4/2 heads, RoPE)", qwen2),
    "mistral": ("transformers", "MistralForCausalLM (GQA 4/2 heads, RoPE, sliding window)", mistral),
    "bert": ("transformers", "BertForMaskedLM", bert),
    "t5": ("transformers", "T5ForConditionalGeneration", t5),
    "vit": ("timm", "vit_tiny_patch16_224 (2 blocks, 64x64 images)", vit),
    "resnet": ("timm", "resnet10t at half width (channels 32-256)", resnet),
    "lora": ("peft", "LoRA r=8 on LlamaForCausalLM, base frozen", lora),
    "compiled": ("transformers", "LlamaForCausalLM, 4 layers, each torch.compile'd", compiled),
}
