"""The drop-ins: ringattn.Attention (a torch.nn.Module) against the same projections around the
plain-torch oracle, and attn_implementation="ringattn" in Hugging Face transformers against the
model's eager attention (skipped where transformers is not installed): same logits, the
sliding window of a Mistral model, packed sequences (cu_seq_lens_q), and padding refused."""
import pytest
import torch

import ringattn
from reference import attention as reference
from reference import relative_error


@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=True, window=(5, None)),
                                dict(causal=False, window=(4, 3))],
                         ids=["causal", "window", "two_sided"])
def test_attention_module_matches_the_oracle(gen, kw):
    """f64: forward and every parameter's gradient within 1e-10 (relative) of the same module
    computed with the oracle, with GQA and packed documents."""
    layer = ringattn.Attention(24, 4, 2, head_dim=8, dtype=torch.float64, **kw)
    x = torch.randn(2, 23, 24, generator=gen, dtype=torch.float64)
    docs = torch.tensor([7, 15])
    out = layer(x, document_starts=docs)
    out.square().sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    b, s, _ = x.shape
    q = layer.q_proj(x).view(b, s, 4, 8)
    k = layer.k_proj(x).view(b, s, 2, 8)
    v = layer.v_proj(x).view(b, s, 2, 8)
    o, _ = reference(q, k, v, causal=kw["causal"], window=kw.get("window"), document_starts=docs)
    ref = layer.o_proj(o.reshape(b, s, 32))
    ref.square().sum().backward()
    assert relative_error(out, ref) < 1e-10
    for p, g in zip(layer.parameters(), grads):
        assert relative_error(g, p.grad) < 1e-10


def test_attention_module_checks_its_arguments():
    with pytest.raises(ValueError, match="num_heads is 6, num_kv_heads 4"):
        ringattn.Attention(24, 6, 4)
    with pytest.raises(TypeError, match="ring is int"):
        ringattn.Attention(24, 4, ring=3)


transformers = pytest.importorskip("transformers", reason="transformers is not installed")


def tiny(config_class, model_class, implementation, **extra):
    config = config_class(vocab_size=64, hidden_size=64, intermediate_size=96,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=256, **extra)
    config._attn_implementation = implementation
    torch.manual_seed(5)
    return model_class(config).double()


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls that reach ringattn's attention through transformers."""
    from ringattn import _modules
    count = [0]
    original = _modules.transformers_attention

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)
    monkeypatch.setattr(_modules, "transformers_attention", counted)
    assert ringattn.register_transformers()
    return count


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_transformers_attn_implementation_matches_eager(gen, calls, family):
    """f64 models: the logits with attn_implementation="ringattn" within 1e-6 (relative; the
    eager softmax runs in fp32) of "eager", and the gradients of every parameter alike; Mistral
    with a sliding window shorter than the sequence."""
    if family == "llama":
        classes, extra = (transformers.LlamaConfig, transformers.LlamaForCausalLM), {}
    else:
        classes, extra = (transformers.MistralConfig, transformers.MistralForCausalLM), \
            dict(sliding_window=9)
    eager = tiny(*classes, "eager", **extra)
    ours = tiny(*classes, "ringattn", **extra)
    ours.load_state_dict(eager.state_dict())
    tokens = torch.randint(0, 64, (2, 40), generator=gen)
    expected, actual = eager(tokens).logits, ours(tokens).logits
    assert calls[0] == 2  # one call a layer
    assert relative_error(actual, expected) < 1e-6
    expected.sum().backward()
    actual.sum().backward()
    for (name, p), q in zip(eager.named_parameters(), ours.parameters()):
        assert relative_error(q.grad, p.grad) < 1e-5, name


def test_transformers_padding_is_refused(gen, calls):
    model = tiny(transformers.LlamaConfig, transformers.LlamaForCausalLM, "ringattn")
    tokens = torch.randint(0, 64, (2, 12), generator=gen)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0
    with pytest.raises(NotImplementedError, match="pack sequences"):
        model(tokens, attention_mask=mask)


def test_transformers_packed_sequences_are_documents(gen):
    """cu_seq_lens_q (as transformers passes packed sequences to flash attention): the packed
    batch equals each sequence attended alone."""
    from ringattn._modules import transformers_attention
    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = (torch.randn(1, 4, 30, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 11, 30], dtype=torch.int32)
    out, _ = transformers_attention(module, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    for a, b in ((0, 11), (11, 30)):
        alone, _ = transformers_attention(module, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], None)
        assert relative_error(out[:, a:b], alone) < 1e-12
