"""The oracle: attention in fp64 in plain torch, materialising the scores, differentiable by
torch.autograd. Independent of ringattn: only torch's einsum, exp, log and sum."""
import torch


def visibility(q_len, k_len, causal=False, q_start=0, k_start=0, window=None,
               document_starts=None, device=None):
    """The mask from its definition, as a boolean [B or 1, q_len, k_len]: the query at global
    position p = q_start + i sees the key at r = k_start + j when (causal) r <= p, (window
    (left, right), 0 or None: no limit) p - r < left and r - p < right, and (document_starts,
    [count] or [B, count]) p and r lie in the same document, the document of a position being
    the number of starts at or before it."""
    p = (q_start + torch.arange(q_len, device=device))[:, None]
    r = (k_start + torch.arange(k_len, device=device))[None, :]
    visible = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        visible &= r <= p
    left, right = window if window is not None else (None, None)
    if left:
        visible &= p - r < left
    if right:
        visible &= r - p < right
    visible = visible[None]
    if document_starts is not None and document_starts.shape[-1] > 0:
        starts = document_starts.to(device).reshape(-1, document_starts.shape[-1])  # [B or 1, n]
        doc_p = (starts[:, None, :] <= p[None]).sum(-1)  # [B or 1, q_len]
        doc_r = (starts[:, None, :] <= r[0][None, :, None]).sum(-1)  # [B or 1, k_len]
        visible = visible & (doc_p[:, :, None] == doc_r[:, None, :])
    return visible


def attention(q, k, v, causal=False, scale=None, q_start=0, k_start=0, dtype=torch.float64,
              window=None, document_starts=None):
    """(O, LSE) of softmax(q k^T * scale + mask) v computed in dtype (fp64: the oracle; the
    inputs' own dtype: the naive computation's rounding, for an error baseline); q, k, v
    [B, S, H, D] of any dtype; the mask of visibility(). Rows that see no key: O = 0,
    LSE = -inf, zero gradients."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    q_len, q_heads, head_dim = q.shape[1], q.shape[2], q.shape[3]
    k_len, kv_heads = k.shape[1], k.shape[2]
    if scale is None:
        scale = head_dim ** -0.5
    group = q_heads // kv_heads
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    visible = visibility(q_len, k_len, causal, q_start, k_start, window, document_starts,
                         q.device)[:, None]  # [B or 1, 1, q_len, k_len]
    s = s.masked_fill(~visible, float("-inf"))
    # A row's maximum, 0 where the row sees nothing, so that exp() never meets -inf - -inf.
    m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    seen = total > 0
    safe_total = torch.where(seen, total, torch.ones_like(total))
    p = e / safe_total
    o = torch.einsum("bhij,bjhd->bihd", p, v)
    lse = torch.where(seen, torch.log(safe_total) + m, torch.full_like(m, float("-inf")))
    return o, lse.squeeze(-1)


def relative_error(out, ref):
    """||out - ref|| / ||ref|| in fp64 (the absolute error where ref is zero)."""
    out, ref = out.double(), ref.double()
    den = ref.norm().item()
    num = (out - ref).norm().item()
    return num / den if den > 0 else num


class TinyAttentionModel(torch.nn.Module):
    """x [B, S, E] -> projections -> GQA causal attention through `attend` (ringattn.attention,
    or a ring over this rank's tokens) -> projection, plus the LSE's mean: a small model for
    torch.compile tests. `attend(q, k, v, causal=True, return_lse=True)` returns (O, LSE)."""

    def __init__(self, attend, embed=32, heads=4, kv_heads=2, head_dim=8, dtype=torch.float32):
        super().__init__()
        self.attend, self.heads, self.kv_heads, self.head_dim = attend, heads, kv_heads, head_dim
        self.q = torch.nn.Linear(embed, heads * head_dim, dtype=dtype)
        self.kv = torch.nn.Linear(embed, 2 * kv_heads * head_dim, dtype=dtype)
        self.out = torch.nn.Linear(heads * head_dim, embed, dtype=dtype)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim)
        k, v = self.kv(x).view(b, s, 2 * self.kv_heads, self.head_dim).chunk(2, dim=2)
        o, lse = self.attend(q, k, v, causal=True, return_lse=True)
        return self.out(o.reshape(b, s, -1)) + lse.mean()
