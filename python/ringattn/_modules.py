"""Drop-ins for models: a torch.nn.Module attention layer, and `attn_implementation="ringattn"`
for Hugging Face transformers."""
import torch

from ringattn._ring import RingAttention


class Attention(torch.nn.Module):
    """Multi-head (GQA) self-attention on ringattn: x [batch, seq, embed_dim] -> the same shape.

    Projections q (num_heads * head_dim), k and v (num_kv_heads * head_dim each) and out, then
    ringattn.attention, or with `ring` (a ringattn.RingAttention) ring attention over its ranks,
    where x is this rank's shard of the sequence. causal and window as in ringattn.attention;
    forward(x, document_starts=None) takes packed documents (the whole sequence's starts). RoPE,
    when the model uses it, goes in `rotate(q, k)`: a callable on q and k [batch, seq, heads,
    head_dim] that returns them rotated (by global position; ring.positions gives a shard's).
    """

    def __init__(self, embed_dim, num_heads, num_kv_heads=None, head_dim=None, *, causal=True,
                 window=None, bias=False, ring=None, rotate=None, device=None, dtype=None):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        head_dim = head_dim or embed_dim // num_heads
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"ringattn.Attention: num_heads is {num_heads}, num_kv_heads "
                             f"{num_kv_heads}; expected num_heads a multiple of num_kv_heads")
        if ring is not None and not isinstance(ring, RingAttention):
            raise TypeError(f"ringattn.Attention: ring is {type(ring).__name__}; expected a "
                            "ringattn.RingAttention or None")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.causal, self.window, self.ring, self.rotate = causal, window, ring, rotate
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.q_proj = torch.nn.Linear(embed_dim, num_heads * head_dim, **kw)
        self.k_proj = torch.nn.Linear(embed_dim, num_kv_heads * head_dim, **kw)
        self.v_proj = torch.nn.Linear(embed_dim, num_kv_heads * head_dim, **kw)
        self.o_proj = torch.nn.Linear(num_heads * head_dim, embed_dim, **kw)

    def forward(self, x, document_starts=None):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        if self.rotate is not None:
            q, k = self.rotate(q, k)
        if self.ring is not None:
            o = self.ring(q, k, v, causal=self.causal, window=self.window,
                          document_starts=document_starts)
        else:
            from ringattn import attention
            o = attention(q, k, v, causal=self.causal, window=self.window,
                          document_starts=document_starts)
        return self.o_proj(o.reshape(b, s, self.num_heads * self.head_dim))


def transformers_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                           is_causal=None, **kwargs):
    """The attention function Hugging Face transformers calls for attn_implementation="ringattn":
    query [batch, heads, seq, head_dim], key and value [batch, kv_heads, seq, head_dim] ->
    (output [batch, seq, heads, head_dim], None). Causal as the module says (is_causal), the
    model's sliding window (kwargs sliding_window, which counts the query's own key too, as
    ringattn's window_left does), packed sequences given as cu_seq_lens_q (what
    DataCollatorWithFlattening makes for flash attention: batch 1). A padding mask, dropout and
    attention weights are refused by name: ringattn computes exact attention over whole
    sequences; pack them as documents instead of padding them."""
    from ringattn import attention
    if attention_mask is not None:
        raise NotImplementedError(
            "ringattn attention: an attention_mask (padding) reached it; ringattn takes causal "
            "masks, sliding windows and packed documents only: pack sequences (cu_seq_lens_q, "
            "e.g. DataCollatorWithFlattening) instead of padding them")
    if dropout and module.training:
        raise NotImplementedError(f"ringattn attention: dropout {dropout}; ringattn has none")
    if kwargs.get("output_attentions"):
        raise NotImplementedError("ringattn attention: output_attentions; it never forms them")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window = kwargs.get("sliding_window")
    documents = kwargs.get("cu_seq_lens_q")
    if documents is not None:
        if query.shape[0] != 1:
            raise ValueError(f"ringattn attention: cu_seq_lens_q with batch {query.shape[0]}; "
                             "packed sequences come as batch 1")
        documents = documents.to(torch.int64)
    o = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                  causal=bool(causal), scale=scaling,
                  window=(int(window), None) if window else None, document_starts=documents)
    return o, None


def register_transformers():
    """Registers "ringattn" with Hugging Face transformers' AttentionInterface, so that
    from_pretrained(..., attn_implementation="ringattn") (or config._attn_implementation) selects
    ringattn's attention. Returns False where transformers is not installed (or too old to have
    AttentionInterface), True once registered."""
    try:
        from transformers import AttentionInterface
    except ImportError:
        return False
    AttentionInterface.register("ringattn", transformers_attention)
    # The masks of flash attention: none, or the 2D padding mask where a row is padded, which
    # transformers_attention then refuses (with no mask function registered, transformers would
    # build none and drop the padding silently).
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        AttentionMaskInterface.register("ringattn", ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    except (ImportError, KeyError):
        pass
    return True
