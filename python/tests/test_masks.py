"""ringattn.attention's sliding window and packed documents (window=, document_starts=) on the
CPU block (f32, f64) against the plain-torch oracle of reference.py, whose boolean mask is built
from the definition (reference.visibility), not from the library.

Criteria as in test_attention.py: relative error under 1e-12 (f64) and 1e-5 (f32) for O and LSE,
under 1e-10 (f64) and 1e-5 (f32) for dQ, dK and dV; what no key reaches (O, LSE, dQ of a row that
sees nothing, dK and dV of a key nobody sees) exactly 0, -inf, 0. The CPU block's tiles are
64 x 64: starts and window widths sit on and beside the edges 64 and 128.
"""
import functools
import random

import pytest
import torch

import ringattn
from conftest import SEED
from reference import attention as reference
from random_masks import random_mask
from reference import TinyAttentionModel, relative_error, visibility
from test_attention import FORWARD_TOL, GRAD_TOL, check_close, check_lse, inputs, randn


def starts(*lists):
    """An int64 tensor of document starts: one list ([count]) or one a batch row."""
    return torch.tensor(lists[0] if len(lists) == 1 else lists, dtype=torch.int64)


# (name, shape (batch, q_len, k_len, q_heads, kv_heads, head_dim, v_head_dim), keywords).
CASES = [
    ("causal window 70", (2, 150, 150, 4, 2, 16, 16), dict(causal=True, window=(70, 0))),
    ("window 64 left 65 right", (1, 131, 131, 4, 1, 16, 16), dict(window=(64, 65))),
    ("causal window 1", (2, 67, 67, 2, 2, 8, 8), dict(causal=True, window=(1, None))),
    ("window right only", (2, 67, 90, 8, 2, 16, 8), dict(window=(None, 17))),
    ("documents at tile edges", (2, 150, 150, 4, 2, 16, 16),
     dict(document_starts=starts([0, 64, 128]))),
    ("causal documents beside tile edges", (2, 150, 150, 8, 1, 16, 16),
     dict(causal=True, document_starts=starts([63, 65, 127, 129]))),
    ("per-batch documents", (2, 131, 131, 4, 2, 16, 16),
     dict(causal=True, document_starts=starts([0, 40, 64, 100], [0, 77, 77, 200]))),
    ("cu_seqlens int32 with the end", (1, 100, 100, 4, 4, 8, 8),
     dict(document_starts=torch.tensor([0, 30, 31, 100], dtype=torch.int32))),
    ("documents and a window", (2, 131, 131, 4, 2, 16, 16),
     dict(window=(40, 10), document_starts=starts([0, 64, 100]))),
    ("causal documents and a window, GQA 8", (2, 150, 150, 8, 1, 16, 24),
     dict(causal=True, window=(65, 0), document_starts=starts([0, 50], [10, 128]))),
    # Queries at 200..239 against keys at 0..129: rows after 170 + 30 see nothing, rows from 210
    # lie in a document of their own.
    ("offsets, rows that see nothing", (2, 40, 130, 4, 2, 16, 16),
     dict(causal=True, q_start=200, window=(35, 0), document_starts=starts([100, 210]))),
]


def reference_of(q, k, v, kw):
    return reference(q, k, v, causal=kw.get("causal", False), scale=kw.get("scale"),
                     q_start=kw.get("q_start", 0), k_start=kw.get("k_start", 0),
                     window=kw.get("window"), document_starts=kw.get("document_starts"))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name,shape,kw", CASES, ids=[c[0].replace(" ", "_") for c in CASES])
def test_masks_match_the_oracle(gen, dtype, name, shape, kw):
    blind, unseen = check_masked_call(gen, dtype, shape, kw, f"{name} {dtype}")
    if name.startswith("offsets"):
        assert blind.any() and unseen.any(), f"{name}: meant to have rows and keys nothing reaches"


# The randomized differential check on one process: problems of random shapes (lengths 1 to 200
# across the CPU block's 64-wide tiles, q_len != k_len, GQA 1 to 3, head dims 1 to 24 with
# v_head_dim apart), offsets, gains up to 64 (scores up to about 1e4) and random_mask's masks,
# in f64 against the oracle, each checked as the cases above are. About 1 s.
RANDOM_CASES = 300


def test_random_masks_match_the_oracle(gen):
    rng = random.Random(int(torch.randint(2**62, (1,), generator=gen)))
    lengths = [1, 2, 5, 17, 63, 64, 65, 127, 129, 200]
    for case in range(RANDOM_CASES):
        batch, kv_heads = rng.choice([1, 2]), rng.choice([1, 2])
        head_dim = rng.choice([1, 3, 8, 16, 24])
        shape = (batch, rng.choice(lengths), rng.choice(lengths), kv_heads * rng.choice([1, 2, 3]),
                 kv_heads, head_dim, rng.choice([head_dim, 2, 8, 16]))
        kw = dict(q_start=rng.choice([0, 0, 5, shape[2], rng.randrange(300)]),
                  k_start=rng.choice([0, 0, 3, rng.randrange(300)]))
        mask = random_mask(rng, max(kw["q_start"] + shape[1], kw["k_start"] + shape[2]), batch,
                           edges=(64, 128))
        if mask["document_starts"] is not None:
            mask["document_starts"] = torch.tensor(mask["document_starts"], dtype=torch.int64)
        kw.update({key: value for key, value in mask.items() if value is not None})
        gain = rng.choice([1.0, 1.0, 4.0, 64.0])
        check_masked_call(gen, torch.float64, shape, kw,
                          f"random case {case} of {RANDOM_CASES}: shape {shape}, {kw}, gain "
                          f"{gain} (seed {SEED})", gain=gain)


def check_masked_call(gen, dtype, shape, kw, what, gain=1.0):
    """O, LSE and the gradients of a loss over both against the oracle (q and k scaled by gain);
    what nothing reaches is exactly zero. Returns the rows that see no key [B, q_len] and the
    keys that no row sees [B, k_len]."""
    q, k, v = inputs(gen, shape, dtype, requires_grad=True)
    if gain != 1.0:
        q, k = (t.detach().mul(gain).requires_grad_() for t in (q, k))
    o, lse = ringattn.attention(q, k, v, return_lse=True, **kw)
    do = randn(gen, *o.shape, dtype=torch.float64)
    dlse = randn(gen, *lse.shape, dtype=torch.float64)
    finite = torch.isfinite(lse.detach())
    ((o.double() * do).sum() + (lse.double() * dlse)[finite].sum()).backward()

    rq, rk, rv = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_o, ref_lse = reference_of(rq, rk, rv, kw)
    ref_finite = torch.isfinite(ref_lse.detach())
    ((ref_o * do).sum() + (ref_lse * dlse)[ref_finite].sum()).backward()
    check_close(o, ref_o, FORWARD_TOL[dtype], what + " O")
    check_lse(lse, ref_lse, FORWARD_TOL[dtype], what)
    for n, t, r in (("dq", q, rq), ("dk", k, rk), ("dv", v, rv)):
        check_close(t.grad, r.grad, GRAD_TOL[dtype], f"{what} {n}")

    seen = visibility(shape[1], shape[2], kw.get("causal", False), kw.get("q_start", 0),
                      kw.get("k_start", 0), kw.get("window"), kw.get("document_starts"))
    seen = seen.expand(shape[0], -1, -1)
    blind = ~seen.any(dim=2)  # [B, q_len]: rows that see no key
    unseen = ~seen.any(dim=1)  # [B, k_len]: keys no row sees
    assert torch.equal(o.detach()[blind], torch.zeros_like(o.detach()[blind])), what
    assert torch.isneginf(lse.detach().transpose(1, 2)[blind]).all(), what
    assert torch.equal(q.grad[blind], torch.zeros_like(q.grad[blind])), what
    assert torch.equal(k.grad[unseen], torch.zeros_like(k.grad[unseen])), what
    assert torch.equal(v.grad[unseen], torch.zeros_like(v.grad[unseen])), what
    return blind, unseen


def test_the_mask_changes_the_result(gen):
    """Each term narrows what is seen: the results differ from the call without it (so the tests
    above can fail when a term is dropped on the way to the library)."""
    q, k, v = inputs(gen, (2, 70, 70, 4, 2, 8, 8), torch.float64)
    plain = ringattn.attention(q, k, v, causal=True)
    for kw in (dict(window=(20, 0)), dict(document_starts=starts([0, 35])),
               dict(document_starts=starts([0, 70], [0, 35]))):
        out = ringattn.attention(q, k, v, causal=True, **kw)
        assert not torch.equal(out, plain), kw
    # Per-batch lists: row 0's single document gives row 0 the plain result.
    per_batch = ringattn.attention(q, k, v, causal=True, document_starts=starts([0, 70], [0, 35]))
    assert torch.equal(per_batch[0], plain[0]) and not torch.equal(per_batch[1], plain[1])


def test_one_list_for_every_row_equals_it_repeated(gen):
    """[count], [1, count] and the list repeated per batch row ([batch, count], also as a
    non-contiguous view) give bitwise the same result."""
    q, k, v = inputs(gen, (3, 50, 50, 4, 2, 8, 8), torch.float32)
    one = starts([0, 17, 33])
    expected = ringattn.attention(q, k, v, document_starts=one, window=(9, 9))
    wide = torch.zeros(3, 6, dtype=torch.int64)
    wide[:, ::2] = one
    for variant in (one[None], one.expand(3, 3), one.repeat(3, 1), wide[:, ::2]):
        out = ringattn.attention(q, k, v, document_starts=variant, window=(9, 9))
        assert torch.equal(out, expected), list(variant.shape)


def test_gradcheck_with_windows_and_documents(gen):
    """Central finite differences in fp64 of O and LSE under a window and per-batch documents,
    GQA and v_head_dim != head_dim (every row sees a key: LSE stays finite), and of O where some
    rows see nothing."""
    q, k, v = inputs(gen, (2, 9, 11, 4, 2, 6, 3), torch.float64, requires_grad=True)
    docs = starts([0, 4, 7], [2, 2, 9])

    def f(q, k, v):
        return ringattn.attention(q, k, v, causal=True, q_start=2, window=(4, None),
                                  document_starts=docs, return_lse=True)
    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6)

    def g(q, k, v):  # rows at 0 and 1 in a document of no key's: O = 0
        return ringattn.attention(q, k, v, window=(3, 2), k_start=2,
                                  document_starts=starts([2, 8]))
    assert torch.autograd.gradcheck(g, (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_opcheck_with_documents(gen):
    q, k, v = (t.requires_grad_() for t in inputs(gen, (2, 9, 7, 4, 2, 8, 5), torch.float64))
    docs = starts([0, 3, 5], [1, 4, 4])
    args = (q, k, v, docs, True, 0.4, 2, 0, 3, 2, False)
    torch.library.opcheck(torch.ops.ringattn.attention_forward.default, args)
    o, lse = torch.ops.ringattn.attention_forward(*[a.detach() if torch.is_tensor(a) else a
                                                    for a in args])
    do = randn(gen, *o.shape, dtype=o.dtype)
    dlse = randn(gen, *lse.shape, dtype=lse.dtype)
    torch.library.opcheck(torch.ops.ringattn.attention_backward.default,
                          (do, dlse, q.detach(), k.detach(), v.detach(), o, lse, docs, True, 0.4,
                           2, 0, 3, 2, False))


def test_meta_tensors_with_documents():
    q = torch.empty(3, 10, 8, 64, device="meta")
    k = torch.empty(3, 12, 2, 64, device="meta")
    docs = torch.empty(3, 4, dtype=torch.int64, device="meta")
    o, lse = ringattn.attention(q, k, k, causal=True, window=(5, 0), document_starts=docs,
                                return_lse=True)
    assert o.shape == (3, 10, 8, 64) and lse.shape == (3, 8, 10) and o.device.type == "meta"


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_torch_compile_fullgraph_with_a_window_and_documents(backend):
    torch._dynamo.reset()
    torch.manual_seed(SEED)
    docs = starts([0, 7, 15], [0, 11, 11])
    model = TinyAttentionModel(functools.partial(ringattn.attention, window=(6, None),
                                                 document_starts=docs))
    x = torch.randn(2, 19, 32)
    eager_out = model(x)
    eager_out.square().mean().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out = torch.compile(model, fullgraph=True, backend=backend)(x)
    out.square().mean().backward()
    check_close(out, eager_out, 1e-5, f"{backend} output")
    for p, g in zip(model.parameters(), eager_grads):
        check_close(p.grad, g, 1e-5, f"{backend} gradient")
    plain = TinyAttentionModel(ringattn.attention)
    plain.load_state_dict(model.state_dict())
    assert not torch.equal(plain(x), eager_out), "the mask did not reach the compiled call"


def test_errors_name_the_argument(gen):
    q, k, v = inputs(gen, (2, 8, 8, 4, 2, 16, 16), torch.float32)
    python_cases = [
        (dict(window=5), TypeError, r"window is 5; expected a pair \(left, right\)"),
        (dict(window=(1, 2, 3)), TypeError, r"window is \(1, 2, 3\); expected a pair"),
        (dict(window=(2.5, 0)), TypeError, r"window's left width is 2.5; expected an int"),
        (dict(window=(0, True)), TypeError, r"window's right width is True; expected an int"),
        (dict(document_starts=[0, 4]), TypeError, r"document_starts is a list; expected an int64"),
        (dict(document_starts=torch.tensor([0.0, 4.0])), TypeError,
         r"document_starts has dtype torch.float32; expected torch.int64"),
        (dict(document_starts=starts([0, 4]).to("meta")), ValueError,
         r"document_starts is on meta but q is on cpu"),
        (dict(document_starts=torch.zeros(3, 2, dtype=torch.int64)), ValueError,
         r"document_starts has shape \[3, 2\]; expected \[count\] or \[batch, count\] with "
         r"batch 2 \(or 1\)"),
        (dict(document_starts=torch.zeros(2, 2, 2, dtype=torch.int64)), ValueError,
         r"document_starts has shape \[2, 2, 2\]"),
    ]
    for kw, kind, pattern in python_cases:
        with pytest.raises(kind, match=pattern):
            ringattn.attention(q, k, v, **kw)
    # The library's checks, its message carried by RingattnError.
    library_cases = [
        (dict(window=(-1, 0)), r"ringattn_attention_forward: window_left is -1; expected 0"),
        (dict(window=(0, -3)), r"ringattn_attention_forward: window_right is -3; expected 0"),
        (dict(document_starts=starts([0, 5, 3])),
         r"ringattn_attention_forward: document start 2 of batch row 0 is 3, below start 1 \(5\)"),
        (dict(document_starts=starts([0, 5], [6, 2])),
         r"document start 1 of batch row 1 is 2, below start 0 \(6\)"),
    ]
    for kw, pattern in library_cases:
        with pytest.raises(ringattn.RingattnError, match=pattern) as info:
            ringattn.attention(q, k, v, **kw)
        assert info.value.status == 1, str(info.value)
