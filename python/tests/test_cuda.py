"""ringattn.attention on the CUDA block (bf16, f16): skipped without a GPU.

Criterion (the FlashAttention one, docs/testing.md): with ref the fp64 oracle and low naive
attention computed in the inputs' dtype on the same inputs, pass when
max|out - ref| <= 2 * max|low - ref| + 1e-5, for O, LSE, dQ, dK and dV.
"""
import pytest
import torch

import ringattn
from conftest import SEED, cuda_devices
from reference import attention as reference


pytestmark = pytest.mark.skipif(cuda_devices() == 0,
                                reason="needs a CUDA GPU and a library built with CUDA")


def within_bound(out, low, ref, what):
    finite = torch.isfinite(ref)
    err = (out.double() - ref)[finite].abs().max().item()
    low_err = (low.double() - ref)[finite].abs().max().item()
    bound = 2 * low_err + 1e-5
    assert err <= bound, f"{what}: error {err:.3g}, {low.dtype} naive {low_err:.3g} (seed {SEED})"


def run(q, k, v, do, dlse, **mask):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o, lse = ringattn.attention(q, k, v, return_lse=True, **mask)
    ((o.float() * do.float()).sum() + (lse * dlse).sum()).backward()
    return o, lse, q.grad, k.grad, v.grad


def naive(q, k, v, do, dlse, dtype, **mask):
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    o, lse = reference(q, k, v, dtype=dtype, **mask)
    finite = torch.isfinite(lse)
    ((o * do.to(dtype)).sum() + (lse[finite] * dlse.to(dtype)[finite]).sum()).backward()
    return o, lse, q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (192, 128)], ids=["64", "128", "192v128"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 1000, 1000, 8, 2), (1, 127, 300, 4, 4), (1, 17, 17, 8, 1)])
def test_cuda_matches_reference(dtype, dims, causal, shape):
    g = torch.Generator(device="cuda").manual_seed(SEED)
    b, sq, sk, hq, hkv = shape
    head_dim, v_head_dim = dims  # 192/128: Q and K wider than V (multi-head latent attention)
    q = torch.randn(b, sq, hq, head_dim, device="cuda", generator=g).to(dtype)
    k = torch.randn(b, sk, hkv, head_dim, device="cuda", generator=g).to(dtype)
    v = torch.randn(b, sk, hkv, v_head_dim, device="cuda", generator=g).to(dtype)
    do = torch.randn(b, sq, hq, v_head_dim, device="cuda", generator=g).to(dtype)
    dlse = torch.randn(b, hq, sq, device="cuda", generator=g)
    mask = dict(causal=causal, q_start=sk - sq if causal else 0)
    try:
        out = run(q, k, v, do, dlse, **mask)
    except ringattn.RingattnError as error:
        if "left out of this build" in str(error):
            pytest.skip(str(error))
        raise
    assert out[0].dtype == dtype and out[1].dtype == torch.float32
    assert all(t.dtype == dtype for t in out[2:])
    ref = naive(q, k, v, do, dlse, torch.float64, **mask)
    low = naive(q, k, v, do, dlse, dtype, **mask)
    for name, x, lo, r in zip(("O", "LSE", "dQ", "dK", "dV"), out, low, ref):
        within_bound(x, lo, r, f"{dtype} d{head_dim} causal={causal} {shape} {name}")


def test_cuda_uses_the_current_stream():
    g = torch.Generator(device="cuda").manual_seed(SEED)
    q, k, v = (torch.randn(1, 512, 4, 64, device="cuda", generator=g).bfloat16()
               for _ in range(3))
    expected = ringattn.attention(q, k, v, causal=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        o = ringattn.attention(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(o, expected)


def test_cuda_compile_fullgraph():
    from reference import TinyAttentionModel
    torch._dynamo.reset()
    torch.manual_seed(SEED)
    model = TinyAttentionModel(ringattn.attention, embed=256, heads=4, kv_heads=2, head_dim=64,
                               dtype=torch.bfloat16).cuda()
    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16)
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True)(x)
    assert torch.allclose(compiled.float(), eager.float(), atol=2e-2, rtol=2e-2)
    compiled.float().square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_cuda_errors_name_the_argument():
    q = torch.randn(1, 16, 2, 64, device="cuda").bfloat16()
    v = torch.randn(1, 16, 2, 32, device="cuda").bfloat16()
    with pytest.raises(ringattn.RingattnError, match="64") as info:
        ringattn.attention(q, q, v)
    assert info.value.status == 2  # unsupported: the CUDA block takes v_head_dim == head_dim
    with pytest.raises(ringattn.RingattnError, match="f32"):
        ringattn.attention(q.float(), q.float(), q.float())
    with pytest.raises(ValueError, match="k is on cpu but q is on cuda"):
        ringattn.attention(q, q.cpu(), q)
