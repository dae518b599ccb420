"""ringattn.attention on the CPU block (f32, f64) against the fp64 oracle in reference.py:
values, LSE, gradients, masks by global position, layouts, gradcheck, torch.compile and errors.

Criteria: relative error ||out - ref|| / ||ref|| under 1e-12 (f64) and 1e-5 (f32) for O and
LSE, under 1e-10 (f64) and 1e-5 (f32) for dQ, dK and dV against torch.autograd on the oracle.
"""
import pytest
import torch

import ringattn
from conftest import SEED
from reference import attention as reference
from reference import TinyAttentionModel, relative_error

FORWARD_TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
GRAD_TOL = {torch.float64: 1e-10, torch.float32: 1e-5}

# (batch, q_len, k_len, q_heads, kv_heads, head_dim, v_head_dim): lengths that break tiles
# (1, 17, 127, 129), q_len != k_len, GQA ratios 1, 2, 4, 8, v_head_dim != head_dim (MLA's 192/128
# and smaller ones).
SHAPES = [
    (1, 1, 1, 1, 1, 8, 8),
    (2, 17, 17, 4, 4, 16, 16),
    (2, 17, 33, 4, 1, 32, 32),
    (1, 127, 129, 8, 2, 64, 64),
    (3, 5, 40, 8, 1, 24, 12),
    (1, 33, 20, 2, 2, 192, 128),
]


def randn(gen, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def inputs(gen, shape, dtype, requires_grad=False):
    b, sq, sk, hq, hkv, d, dv = shape
    q = randn(gen, b, sq, hq, d, dtype=dtype)
    k = randn(gen, b, sk, hkv, d, dtype=dtype)
    v = randn(gen, b, sk, hkv, dv, dtype=dtype)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def check_lse(lse, ref_lse, tol, what):
    """The same rows at -inf, and the finite ones within tol."""
    assert lse.shape == ref_lse.shape, what
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), f"{what}: -inf rows differ"
    finite = torch.isfinite(ref_lse)
    assert torch.isfinite(lse[finite]).all(), f"{what}: LSE not finite where the oracle's is"
    err = relative_error(lse[finite], ref_lse[finite])
    assert err < tol, f"{what}: LSE relative error {err:.3g} >= {tol:g} (seed {SEED})"


def check_close(out, ref, tol, what):
    assert out.shape == ref.shape, f"{what}: shape {list(out.shape)} vs {list(ref.shape)}"
    assert torch.isfinite(out).all(), f"{what}: not finite (seed {SEED})"
    err = relative_error(out, ref)
    assert err < tol, f"{what}: relative error {err:.3g} >= {tol:g} (seed {SEED})"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_matches_reference(gen, dtype, causal, shape):
    q, k, v = inputs(gen, shape, dtype)
    # Causal with q_len != k_len: the queries are the last q_len positions of the keys'.
    q_start = max(shape[2] - shape[1], 0) if causal else 0
    o, lse = ringattn.attention(q, k, v, causal=causal, q_start=q_start, return_lse=True)
    ref_o, ref_lse = reference(q, k, v, causal=causal, q_start=q_start)
    assert o.dtype == dtype and lse.dtype == dtype
    what = f"{dtype} causal={causal} shape={shape}"
    check_close(o, ref_o, FORWARD_TOL[dtype], what + " O")
    check_lse(lse, ref_lse, FORWARD_TOL[dtype], what)
    assert torch.equal(ringattn.attention(q, k, v, causal=causal, q_start=q_start), o)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES[1:], ids=lambda s: "x".join(map(str, s)))
def test_gradients_match_reference(gen, dtype, causal, shape):
    """dQ, dK, dV of a loss over O and LSE (so LSE's gradient is exercised too)."""
    q, k, v = inputs(gen, shape, dtype, requires_grad=True)
    q_start = max(shape[2] - shape[1], 0) if causal else 0
    o, lse = ringattn.attention(q, k, v, causal=causal, q_start=q_start, return_lse=True)
    do = randn(gen, *o.shape, dtype=torch.float64)
    dlse = randn(gen, *lse.shape, dtype=torch.float64)
    ((o.double() * do).sum() + (lse.double() * dlse).sum()).backward()

    rq, rk, rv = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_o, ref_lse = reference(rq, rk, rv, causal=causal, q_start=q_start)
    ((ref_o * do).sum() + (ref_lse * dlse).sum()).backward()
    for name, t, r in (("dq", q, rq), ("dk", k, rk), ("dv", v, rv)):
        assert t.grad.dtype == dtype, f"{name} has dtype {t.grad.dtype}"
        check_close(t.grad, r.grad, GRAD_TOL[dtype], f"{dtype} causal={causal} {shape} {name}")


def test_gradient_of_output_only_and_of_lse_only(gen):
    shape = (2, 19, 23, 4, 2, 16, 8)
    for use_o, use_lse in ((True, False), (False, True)):
        q, k, v = inputs(gen, shape, torch.float64, requires_grad=True)
        o, lse = ringattn.attention(q, k, v, causal=True, q_start=4, return_lse=True)
        ((o.sum() if use_o else 0) + (lse.sum() if use_lse else 0)).backward()
        rq, rk, rv = (t.detach().requires_grad_() for t in (q, k, v))
        ref_o, ref_lse = reference(rq, rk, rv, causal=True, q_start=4)
        ((ref_o.sum() if use_o else 0) + (ref_lse.sum() if use_lse else 0)).backward()
        for name, t, r in (("dq", q, rq), ("dk", k, rk), ("dv", v, rv)):
            # LSE does not depend on V: the oracle leaves no gradient, ringattn a zero one.
            ref_grad = torch.zeros_like(r) if r.grad is None else r.grad
            check_close(t.grad, ref_grad, GRAD_TOL[torch.float64], f"o={use_o} lse={use_lse} {name}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("q_start,k_start", [(0, 7), (5, 9), (100, 90), (3, 0)])
def test_offsets_and_rows_that_see_no_key(gen, dtype, q_start, k_start):
    """Causal by global position: query row i at q_start + i sees key j at k_start + j when
    k_start + j <= q_start + i. Rows that see nothing: O = 0, LSE = -inf, zero dQ; keys no row
    sees: zero dK and dV."""
    shape = (2, 13, 11, 4, 2, 16, 16)
    q, k, v = inputs(gen, shape, dtype, requires_grad=True)
    o, lse = ringattn.attention(q, k, v, causal=True, q_start=q_start, k_start=k_start,
                                return_lse=True)
    do = randn(gen, *o.shape, dtype=dtype)
    o.backward(do)
    rq, rk, rv = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_o, ref_lse = reference(rq, rk, rv, causal=True, q_start=q_start, k_start=k_start)
    ref_o.backward(do.double())
    what = f"{dtype} q_start={q_start} k_start={k_start}"
    check_close(o, ref_o, FORWARD_TOL[dtype], what + " O")
    check_lse(lse, ref_lse, FORWARD_TOL[dtype], what)
    for name, t, r in (("dq", q, rq), ("dk", k, rk), ("dv", v, rv)):
        check_close(t.grad, r.grad, GRAD_TOL[dtype], f"{what} {name}")

    blind = q_start + torch.arange(13) < k_start  # query rows that see no key
    unseen = k_start + torch.arange(11) > q_start + 12  # keys that no query sees
    assert torch.equal(o[:, blind], torch.zeros_like(o[:, blind])), what
    assert torch.isneginf(lse[:, :, blind]).all(), what
    assert torch.equal(q.grad[:, blind], torch.zeros_like(q.grad[:, blind])), what
    assert torch.equal(k.grad[:, unseen], torch.zeros_like(k.grad[:, unseen])), what
    assert torch.equal(v.grad[:, unseen], torch.zeros_like(v.grad[:, unseen])), what


def test_no_row_sees_a_key(gen):
    q, k, v = inputs(gen, (1, 6, 5, 2, 1, 8, 4), torch.float64, requires_grad=True)
    o, lse = ringattn.attention(q, k, v, causal=True, q_start=0, k_start=6, return_lse=True)
    assert torch.equal(o, torch.zeros_like(o))
    assert torch.isneginf(lse).all()
    o.backward(torch.ones_like(o))
    for t in (q, k, v):
        assert torch.equal(t.grad, torch.zeros_like(t))


def test_deterministic_backward_is_bitwise_reproducible(gen):
    q, k, v = inputs(gen, (2, 40, 50, 8, 2, 16, 16), torch.float32)
    do = randn(gen, 2, 40, 8, 16, dtype=torch.float32)
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ringattn.attention(*leaves, causal=True, q_start=10, deterministic=True).backward(do)
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_scale_and_large_logits(gen):
    """An explicit scale, and scores near 1e4 (overflow if the block did not subtract a max)."""
    q, k, v = inputs(gen, (2, 31, 29, 4, 4, 16, 16), torch.float64)
    for scale in (0.05, 1.0, 400.0):
        o, lse = ringattn.attention(q, k, v, scale=scale, return_lse=True)
        ref_o, ref_lse = reference(q, k, v, scale=scale)
        check_close(o, ref_o, 1e-12, f"scale {scale} O")
        check_lse(lse, ref_lse, 1e-12, f"scale {scale}")
    assert (lse.abs().amax() > 1e3).item(), "the large-logit case did not reach large scores"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_strided_views(gen, dtype):
    """Packed QKV views and [B, H, S, D] tensors transposed to [B, S, H, D] go in as views; a
    last axis of stride 2 and a broadcast (stride 0) axis are copied first. Values and gradients
    are those of the contiguous tensors."""
    b, s, h, d = 2, 21, 4, 16
    qkv = randn(gen, b, s, 3 * h, d, dtype=dtype).requires_grad_()
    q, k, v = qkv[:, :, :h], qkv[:, :, h:2 * h], qkv[:, :, 2 * h:]
    assert not q.is_contiguous()
    o = ringattn.attention(q, k, v, causal=True)
    do = randn(gen, *o.shape, dtype=dtype)
    o.backward(do)
    rqkv = qkv.detach().double().requires_grad_()
    ref_o, _ = reference(rqkv[:, :, :h], rqkv[:, :, h:2 * h], rqkv[:, :, 2 * h:], causal=True)
    ref_o.backward(do.double())
    check_close(o, ref_o, FORWARD_TOL[dtype], "packed QKV O")
    check_close(qkv.grad, rqkv.grad, GRAD_TOL[dtype], "packed QKV gradient")

    bhsd = randn(gen, b, h, s, d, dtype=dtype)
    wide = randn(gen, b, s, h, 2 * d, dtype=dtype)
    one_kv = randn(gen, b, s, 1, d, dtype=dtype)
    cases = {
        "transposed q": (bhsd.transpose(1, 2), one_kv.expand(b, s, h, d).contiguous(),
                         one_kv.expand(b, s, h, d).contiguous()),
        "last stride 2": (wide[..., ::2], wide[..., 1::2], wide[..., ::2]),
        "broadcast kv heads": (bhsd.transpose(1, 2), one_kv.expand(b, s, h, d),
                               one_kv.expand(b, s, h, d)),
    }
    for name, (q, k, v) in cases.items():
        o, lse = ringattn.attention(q, k, v, return_lse=True)
        ref_o, ref_lse = reference(q, k, v)
        check_close(o, ref_o, FORWARD_TOL[dtype], name)
        check_lse(lse, ref_lse, FORWARD_TOL[dtype], name)


def test_calls_alike_but_for_one_field_each_get_their_own(gen):
    """The op packs its parameters from a template per call shape (_capi.Packed.pack_cached):
    calls of one shape that differ in strides, dtype, scale, causal, offsets or window, each
    made twice and interleaved with the others, give each its own values and gradients."""
    b, s, h, d = 1, 19, 2, 16
    bhsd = randn(gen, b, h, s, d, dtype=torch.float64)
    base = dict(q=randn(gen, b, s, h, d, dtype=torch.float64), kwargs={})
    variants = {
        "base": base,
        "transposed q": dict(q=bhsd.transpose(1, 2), kwargs={}),
        "f32": dict(q=base["q"].float(), kwargs={}),
        "scale": dict(q=base["q"], kwargs={"scale": 0.7}),
        "causal": dict(q=base["q"], kwargs={"causal": True}),
        "offsets": dict(q=base["q"], kwargs={"causal": True, "q_start": 3, "k_start": 5}),
        "window": dict(q=base["q"], kwargs={"causal": True, "window": (4, None)}),
    }
    k, v = randn(gen, b, s, h, d, dtype=torch.float64), randn(gen, b, s, h, d, dtype=torch.float64)
    do = randn(gen, b, s, h, d, dtype=torch.float64)
    for _ in range(2):
        for name, case in variants.items():
            dtype = case["q"].dtype
            q, kk, vv = (t.detach().clone() if t is not case["q"] else t.detach()
                         for t in (case["q"], k.to(dtype), v.to(dtype)))
            q, kk, vv = (t.requires_grad_() for t in (q, kk, vv))
            o = ringattn.attention(q, kk, vv, **case["kwargs"])
            o.backward(do.to(dtype))
            rq, rk, rv = (t.detach().double().requires_grad_() for t in (q, kk, vv))
            ref_o, _ = reference(rq, rk, rv, **case["kwargs"])
            ref_o.backward(do)
            check_close(o, ref_o, FORWARD_TOL[dtype], name + " O")
            for got, want, what in ((q, rq, "dQ"), (kk, rk, "dK"), (vv, rv, "dV")):
                check_close(got.grad, want.grad, GRAD_TOL[dtype], f"{name} {what}")


def test_randomized_differential(gen):
    """32 random problems (shapes, GQA ratio, head dims, offsets, mask, dtype, scale), each
    forward and backward against the oracle. Scores stay of order 1 to 10 (f64 inputs also of
    gain 2): where softmax saturates, dS = P (dP - delta) cancels and the gradients' relative
    error grows past these tolerances in any implementation (test_scale_and_large_logits
    covers large scores in the forward)."""
    for case in range(32):
        def pick(*choices):
            return choices[torch.randint(len(choices), (), generator=gen).item()]
        dtype = pick(torch.float32, torch.float64)
        kv_heads, group = pick(1, 2, 3), pick(1, 2, 4, 8)
        shape = (pick(1, 2), pick(1, 7, 17, 64, 65), pick(1, 9, 31, 64, 100), kv_heads * group,
                 kv_heads, pick(8, 16, 40, 64), pick(8, 16, 40, 64))
        causal = pick(False, True)
        q_start, k_start = pick(0, 3, 50), pick(0, 5, 60)
        scale = pick(None, 0.3 / shape[5] ** 0.5, 2.0 / shape[5] ** 0.5)
        gain = pick(1.0, 2.0) if dtype == torch.float64 else 1.0
        q, k, v = (t.mul(gain).requires_grad_() for t in inputs(gen, shape, dtype))
        o, lse = ringattn.attention(q, k, v, causal=causal, scale=scale, q_start=q_start,
                                    k_start=k_start, return_lse=True)
        do = randn(gen, *o.shape, dtype=dtype)
        o.backward(do)
        rq, rk, rv = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref_o, ref_lse = reference(rq, rk, rv, causal, scale, q_start, k_start)
        ref_o.backward(do.double())
        what = (f"case {case}: {dtype} shape={shape} causal={causal} q_start={q_start} "
                f"k_start={k_start} scale={scale} gain={gain}")
        check_close(o, ref_o, FORWARD_TOL[dtype], what + " O")
        check_lse(lse, ref_lse, FORWARD_TOL[dtype], what)
        for name, t, r in (("dq", q, rq), ("dk", k, rk), ("dv", v, rv)):
            check_close(t.grad, r.grad, GRAD_TOL[dtype], f"{what} {name}")


def test_gradcheck(gen):
    """Central finite differences in fp64 of O and LSE, causal with GQA, offsets and
    v_head_dim != head_dim (every row sees a key, so LSE stays finite)."""
    q, k, v = inputs(gen, (1, 5, 6, 4, 2, 6, 3), torch.float64, requires_grad=True)

    def f(q, k, v):
        return ringattn.attention(q, k, v, causal=True, q_start=3, k_start=1, return_lse=True)
    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6)

    def g(q, k, v):
        return ringattn.attention(q, k, v, scale=0.7)
    assert torch.autograd.gradcheck(g, (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_opcheck():
    """torch.library.opcheck: the ops' schemas, fake (meta) implementations, autograd
    registration and their agreement with the real implementations."""
    g = torch.Generator().manual_seed(SEED)
    q = torch.randn(2, 9, 4, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, 7, 2, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, 7, 2, 5, dtype=torch.float64, generator=g, requires_grad=True)
    args = (q, k, v, None, True, 0.4, 2, 0, 0, 0, False)
    torch.library.opcheck(torch.ops.ringattn.attention_forward.default, args)
    o, lse = torch.ops.ringattn.attention_forward(*[a.detach() if torch.is_tensor(a) else a
                                                    for a in args])
    do = torch.randn(o.shape, dtype=o.dtype, generator=g)
    dlse = torch.randn(lse.shape, dtype=lse.dtype, generator=g)
    backward_args = (do, dlse, q.detach(), k.detach(), v.detach(), o, lse, None, True, 0.4, 2, 0,
                     0, 0, False)
    torch.library.opcheck(torch.ops.ringattn.attention_backward.default, backward_args)


def test_eager_path_is_bitwise_the_custom_op():
    """A plain eager call goes through one autograd.Function (no custom-op dispatch): the same
    O, LSE and gradients, bitwise, as the custom ops that torch.compile and fake tensors use,
    with a window, documents and a gradient reaching the LSE."""
    g = torch.Generator().manual_seed(SEED)
    q = torch.randn(2, 13, 4, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, 11, 2, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, 11, 2, 6, dtype=torch.float64, generator=g, requires_grad=True)
    starts = torch.tensor([4, 9])
    do = torch.randn(2, 13, 4, 6, dtype=torch.float64, generator=g)
    dlse = torch.randn(2, 4, 13, dtype=torch.float64, generator=g)
    results = []
    for op in (lambda *a: ringattn.attention(*a, causal=True, window=(5, None), q_start=2,
                                             document_starts=starts, return_lse=True),
               lambda *a: torch.ops.ringattn.attention_forward(*a, starts, True, 0.35355339059327373,
                                                                2, 0, 5, 0, False)):
        o, lse = op(q, k, v)
        torch.autograd.backward((o, lse), (do, dlse))
        results.append((o.detach(), lse.detach(), q.grad, k.grad, v.grad, type(o.grad_fn).__name__))
        q.grad = k.grad = v.grad = None
    (eager, op) = results
    assert "EagerAttention" in eager[5] and "EagerAttention" not in op[5], (eager[5], op[5])
    for name, a, b in zip(("O", "LSE", "dQ", "dK", "dV"), eager[:5], op[:5]):
        assert torch.equal(a, b), name


def test_calls_without_gradients_record_no_graph():
    """Inputs that need no gradient, or torch.no_grad: the same O and LSE, bitwise, as a call
    recorded for autograd, and outputs outside any graph. A later call with gradients records
    one again."""
    g = torch.Generator().manual_seed(SEED)
    q, k, v = (torch.randn(1, 9, 2, 8, dtype=torch.float64, generator=g) for _ in range(3))
    recorded = ringattn.attention(q.requires_grad_(), k, v, causal=True, return_lse=True)
    q.requires_grad_(False)
    plain = ringattn.attention(q, k, v, causal=True, return_lse=True)
    with torch.no_grad():
        quiet = ringattn.attention(q.clone().requires_grad_(), k, v, causal=True, return_lse=True)
    assert all(t.grad_fn is not None for t in recorded)
    for name, (o, lse) in (("plain", plain), ("no_grad", quiet)):
        assert o.grad_fn is None and lse.grad_fn is None and not o.requires_grad, name
        assert torch.equal(o, recorded[0].detach()) and torch.equal(lse, recorded[1].detach()), name
    again = ringattn.attention(q, k.requires_grad_(), v, causal=True)
    again.sum().backward()
    assert k.grad is not None and k.grad.abs().sum() > 0


def test_meta_tensors_give_shapes_and_dtypes():
    for dtype, acc in ((torch.float32, torch.float32), (torch.float64, torch.float64),
                       (torch.bfloat16, torch.float32), (torch.float16, torch.float32)):
        q = torch.empty(3, 10, 8, 64, dtype=dtype, device="meta")
        k = torch.empty(3, 12, 2, 64, dtype=dtype, device="meta")
        v = torch.empty(3, 12, 2, 32, dtype=dtype, device="meta")
        o, lse = ringattn.attention(q, k, v, causal=True, return_lse=True)
        assert o.shape == (3, 10, 8, 32) and o.dtype == dtype and o.device.type == "meta"
        assert lse.shape == (3, 8, 10) and lse.dtype == acc


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_torch_compile_fullgraph(backend):
    """torch.compile(fullgraph=True) of a small model through ringattn: the same output and
    parameter gradients as eager mode."""
    torch._dynamo.reset()
    torch.manual_seed(SEED)
    model = TinyAttentionModel(ringattn.attention)
    x = torch.randn(2, 19, 32)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    eager_out = model(x)
    eager_out.square().mean().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out = compiled(x)
    out.square().mean().backward()
    check_close(out, eager_out, 1e-5, f"{backend} output")
    for p, g in zip(model.parameters(), eager_grads):
        check_close(p.grad, g, 1e-5, f"{backend} gradient")


def test_errors_name_the_argument(gen):
    q, k, v = inputs(gen, (1, 8, 8, 4, 2, 16, 16), torch.float32)
    with pytest.raises(ValueError, match=r"k has shape \[8, 2, 16\]; expected rank 4"):
        ringattn.attention(q, k[0], v)
    with pytest.raises(TypeError, match="v has dtype torch.int64"):
        ringattn.attention(q, k, v.long())
    with pytest.raises(ValueError, match="v is on meta but q is on cpu"):
        ringattn.attention(q, k, v.to("meta"))
    with pytest.raises(TypeError, match="ringattn.attention: q is a list; expected a torch.Tensor"):
        ringattn.attention(q.tolist(), k, v)
    with pytest.raises(ValueError, match=r"q has shape \[\]; expected rank 4"):
        ringattn.attention(q[0, 0, 0, 0], k, v)  # no head_dim for the default scale either
    # Everything else is the library's check, its message carried by RingattnError.
    cases = [
        (dict(k=k.double()), r"ringattn_attention_forward: k has dtype f64; expected f32"),
        (dict(q=q[..., :8]), r"ringattn_attention_forward: k has shape \[1, 8, 2, 16\]; "
                             r"expected \[1, 8, 2, 8\]"),
        (dict(v=v[:, :5]), r"ringattn_attention_forward: v has shape \[1, 5, 2, 16\]; "
                           r"expected \[1, 8, 2, 16\]"),
        (dict(q=q[:, :, :3]), r"ringattn_attention_forward: q has 3 heads, not a multiple of "
                              r"the 2 heads of k and v"),
        (dict(scale=-1.0), r"ringattn_attention_forward: scale is -1; expected a finite value"),
        # head_dim 0: the library names it (the default scale does not divide by zero first)
        (dict(q=q[..., :0], k=k[..., :0]), r"ringattn_attention_forward: q has head_dim 0; "
                                           r"expected >= 1"),
        (dict(q=q.bfloat16(), k=k.bfloat16(), v=v.bfloat16()),
         r"q has dtype bf16; the CPU block takes f32 or f64"),
    ]
    for change, pattern in cases:
        args = dict(q=q, k=k, v=v, scale=None)
        args.update(change)
        with pytest.raises(ringattn.RingattnError, match=pattern) as info:
            ringattn.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)
        assert isinstance(info.value, RuntimeError)
        assert info.value.status in (1, 2), str(info.value)
        assert f"(ringattn status {info.value.status}: " in str(info.value)
