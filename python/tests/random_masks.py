"""Random masks for the randomized differential checks (test_masks.py on one process,
test_ring_mpi_random.py across MPI ranks): causal or not, windows of every kind of width (1, a
tile's or a shard's length and beside it, wider than the sequence; one-sided or two-sided) and
packed documents (one list for every batch row or one a row; repeated, out-of-range and
unaligned starts, documents of one token), drawn from a seeded random.Random so that every rank
draws the same case."""


def random_mask(rng, seq, batch, edges=()):
    """Keywords of ringattn.attention's mask (causal, window, document_starts as a list or None)
    for positions in [0, seq): widths and starts are drawn from 1, 2, 3, the given `edges` (tile
    or shard lengths) and their neighbours, seq and beyond, and anywhere."""
    causal = rng.random() < 0.6
    widths = [1, 2, 3, seq, seq + 5] + [e + d for e in edges for d in (-1, 0, 1) if e + d > 0]
    window = None
    if rng.random() < 0.5:
        left = rng.choice([None, rng.randrange(1, seq + 2)] + widths)
        right = None if causal else rng.choice([None, rng.randrange(1, seq + 2)] + widths)
        if left or right:
            window = (left, right)
    documents = None
    if rng.random() < 0.6:
        count = rng.randrange(1, 8)
        places = [0, 1, seq - 1, seq] + [e + d for e in edges for d in (-1, 0, 1)]

        def one_list():
            return sorted(rng.choice([rng.randrange(-2, seq + 3), rng.choice(places)])
                          for _ in range(count))

        per_row = batch > 1 and rng.random() < 0.3
        documents = [one_list() for _ in range(batch)] if per_row else one_list()
    return dict(causal=causal, window=window, document_starts=documents)
