"""The attention planner written as plain loops: one query tile, one token, one KV tile at a
time.  The kit's :func:`batch_invariance_kit.ops.attention.make_plan` builds the same plan from
vectorised host-array operations; the property tests compare the two field by field.

This planner reads only the scalar rule of the schedule (:func:`~batch_invariance_kit.ops.
attention.split_size_at`, :func:`~batch_invariance_kit.ops.attention.query_tile`) and the
number of SMs the variant plans for; everything else (tiles, tokens, split sizes per sequence,
workspace ranks and sizes, decode padding) is spelled out here.
"""
import torch
import triton

from batch_invariance_kit.ops import attention as A
from batch_invariance_kit.ops.attention.schedule import resolve_config


def reference_split_plan(lens: list, kv_heads: int, impl: str, cfg: A.AttnConfig) -> list:
    """Keys per split for each sequence's last position (see :func:`A.split_plan`)."""
    if impl == "invariant":
        return [A.split_size_at(max(n - 1, 0), cfg) for n in lens]
    num_splits = max(1, (2 * A.num_sms()) // max(1, len(lens) * kv_heads))
    return [max(1, triton.cdiv(triton.cdiv(n, num_splits), cfg.block_n)) * cfg.block_n for n in lens]


def reference_max_splits_upto(n: int, cfg: A.AttnConfig) -> int:
    """The most splits a row at a position ``< n`` has under the invariant schedule."""
    ends = {min(j * cfg.block_n + cfg.block_n, n) - 1 for j in range(triton.cdiv(n, cfg.block_n))}
    return max([p // A.split_size_at(p, cfg) + 1 for p in ends] or [1])


def reference_make_plan(seq_lens, query_start_loc, *, q_heads: int, kv_heads: int, head_dim: int,
                        impl: str = "invariant", config=None, device="cpu", decode_capacity=None,
                        max_seq_len=None) -> A.AttnPlan:
    """:func:`A.make_plan` for valid input (lists or 1-D integer tensors), one element at a time."""
    cfg = resolve_config(config)
    lens = [int(x) for x in seq_lens]
    qsl = [int(x) for x in query_start_loc]
    dev = torch.device(device)
    T = qsl[-1]
    q_tile, qpk_pad = A.query_tile(q_heads, kv_heads, cfg)
    dec_q_tile, _ = A.query_tile(q_heads, kv_heads, cfg, decode=True)
    split = reference_split_plan(lens, kv_heads, impl, cfg)
    if impl == "invariant":
        size_at = lambda s, pos: A.split_size_at(pos, cfg)  # noqa: E731
    else:
        size_at = lambda s, pos: split[s]  # noqa: E731
    groups = {"tiles": ([], [], [], [], []), "decode": ([], [], [], [], [])}  # seq, tok, rows, pos, split
    tok_pos, tok_split = [], []
    for s in range(len(lens)):
        a, b = qsl[s], qsl[s + 1]
        first = lens[s] - (b - a)  # position of token a
        one = b - a == 1 and cfg.decode_block_m is not None
        g, qt = (groups["decode"], dec_q_tile) if one else (groups["tiles"], q_tile)
        p = first
        while p < lens[s]:  # tiles cut at the multiples of qt of the position
            end = min((p // qt + 1) * qt, lens[s])
            for lst, val in zip(g, (s, a + p - first, end - p, p, size_at(s, end - 1))):
                lst.append(val)
            p = end
        for pos in range(first, lens[s]):
            tok_pos.append(pos)
            tok_split.append(size_at(s, pos))
    n_dec = len(groups["decode"][0])
    if decode_capacity is not None:
        if n_dec > decode_capacity:
            raise ValueError(f"the step has {n_dec} one-token sequences, more than decode_capacity={decode_capacity}")
        for lst, val in zip(groups["decode"], (0, 0, 0, 0, cfg.block_n)):  # padding tiles: 0 rows
            lst.extend([val] * (decode_capacity - n_dec))
    serial = {k: impl == "invariant" and cfg.serial_programs is not None
              and len(g[0]) * kv_heads >= cfg.serial_programs for k, g in groups.items()}
    merge_tok = sorted(t for k, g in groups.items() if not serial[k]
                       for t0, n in zip(g[1], g[2]) for t in range(t0, t0 + n))
    tok_ws = [0] * T
    for r, t in enumerate(merge_tok):
        tok_ws[t] = r
    if max_seq_len is not None and cfg.split_target is not None and impl == "invariant":
        max_splits = reference_max_splits_upto(max_seq_len, cfg)
    elif max_seq_len is not None:
        max_splits = max(triton.cdiv(max_seq_len, sp) for sp in set(split) | {cfg.block_n})
    else:
        max_splits = max([tok_pos[t] // tok_split[t] + 1 for t in merge_tok] or [1])
    if decode_capacity is not None and not serial["decode"]:
        merge_tok += [-1] * (decode_capacity - n_dec)
    i32 = dict(dtype=torch.int32, device=dev)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    ws_rows = max(1, len(merge_tok) * q_heads * max_splits)
    dec_warps, dec_stages = (cfg.serial_decode_warps, cfg.serial_decode_stages) if serial["decode"] else \
        (cfg.num_warps, cfg.num_stages)

    def group(k, qt, warps, stages):
        return A.TileGroup(qt, *(torch.tensor(x, **i32) for x in groups[k]), serial[k], warps, stages)

    return A.AttnPlan(cfg, impl, T, q_heads, kv_heads, head_dim, qpk_pad,
                      group("tiles", q_tile, cfg.num_warps, cfg.num_stages),
                      group("decode", dec_q_tile, dec_warps, dec_stages),
                      A.MergePlan(torch.tensor(merge_tok, **i32), torch.tensor(tok_ws, **i32),
                                  torch.tensor(tok_pos, **i32), torch.tensor(tok_split, **i32), max_splits,
                                  torch.empty((ws_rows, d_pad), dtype=torch.float32, device=dev),
                                  torch.empty((ws_rows, 2), dtype=torch.float32, device=dev)))


def assert_same_plan(new: A.AttnPlan, ref: A.AttnPlan) -> None:
    """Every field of two plans equal: the scalars and flags, and every index tensor bitwise (dtype,
    device, shape, values); the workspaces (scratch, never read before written) by dtype, device
    and shape."""
    assert type(new) is type(ref)
    for f in ("config", "impl", "num_tokens", "q_heads", "kv_heads", "head_dim", "qpk_pad"):
        a, b = getattr(new, f), getattr(ref, f)
        assert type(a) is type(b) and a == b, (f, a, b)
    for name, ga, gb in (("tiles", new.tiles, ref.tiles), ("decode", new.decode, ref.decode),
                         ("merge", new.merge, ref.merge)):
        assert type(ga) is type(gb), name
        for f, a, b in zip(ga._fields, ga, gb):
            if isinstance(b, torch.Tensor):
                assert isinstance(a, torch.Tensor) and (a.dtype, a.device, a.shape) == (b.dtype, b.device, b.shape), \
                    (name, f, a.dtype, a.device, a.shape, b.dtype, b.device, b.shape)
                assert a.is_contiguous(), (name, f)
                if f not in ("acc", "ml"):
                    assert torch.equal(a, b), (name, f, a, b)
            else:
                assert type(a) is type(b) and a == b, (name, f, a, b)
