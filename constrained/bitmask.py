"""Packed token bitmasks: int32 ``[batch, ceil(vocab_size / 32)]``, bit ``j % 32`` of word ``j // 32``
set when token ``j`` is allowed (the layout xgrammar, llguidance and outlines-core write).

Unpacking one to the vocabulary goes through a byte table: the int32 words are read as their
little-endian bytes (byte ``4w + k`` holds tokens ``32w + 8k`` to ``32w + 8k + 7``, low bit first),
and each byte value looks its 8 bits up in a [256, 8] table, one gather per byte instead of 32 shifts
per word, which takes under half the time.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F

_BYTE_BITS = (torch.arange(256)[:, None] >> torch.arange(8)) & 1  # [256, 8]: a byte's bits, low first
_TABLES: dict[torch.device, torch.Tensor] = {}  # the bit table on each device it was used on


def allocate_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    return torch.full((batch_size, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def bool_to_bitmask(allowed: torch.Tensor, words: int) -> torch.Tensor:
    """bool [V] -> one int32 bitmask row [words] (bit j % 32 of word j // 32; tokens past V refused)."""
    bits = torch.zeros(words * 32, dtype=torch.int64)
    bits[: allowed.numel()] = allowed.to(torch.int64)
    packed = (bits.view(words, 32) << torch.arange(32, dtype=torch.int64)).sum(dim=1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def ids_to_bitmask(token_ids: Iterable[int], words: int) -> torch.Tensor:
    """One int32 bitmask row [words] allowing exactly `token_ids` (ids past the row's bits left out)."""
    allowed = torch.zeros(words * 32, dtype=torch.bool)
    allowed[torch.tensor([t for t in token_ids if t < words * 32], dtype=torch.int64)] = True
    return bool_to_bitmask(allowed, words)


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpack an int32 bitmask [B, W] to a bool mask [B, vocab_size] (True = allowed) on the
    bitmask's device; tokens past W * 32 are disallowed."""
    if sys.byteorder != "little":  # the byte table reads the words' bytes in little-endian order
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        return _fit(((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(-2), vocab_size)
    if bitmask.device.type == "cpu":  # numpy's unpack runs several times the byte table's speed here
        words = bitmask.contiguous().numpy().view(np.uint8)
        return _fit(torch.from_numpy(np.unpackbits(words, axis=-1, bitorder="little")).view(torch.bool), vocab_size)
    return _fit(_expand(bitmask).bool(), vocab_size)


def _expand(bitmask: torch.Tensor) -> torch.Tensor:
    """[B, W] int32 -> [B, W * 32] uint8 bits, via the words' bytes."""
    table = _TABLES.get(bitmask.device)
    if table is None:
        table = _TABLES[bitmask.device] = _BYTE_BITS.to(device=bitmask.device, dtype=torch.uint8)
    rows = bitmask.shape[0]
    byte_values = bitmask.contiguous().view(torch.uint8).long()  # [B, 4W]
    return F.embedding(byte_values, table).view(rows, -1)


def _fit(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, W * 32] bool -> [B, vocab_size]: cut, or padded with disallowed tokens."""
    if bits.shape[-1] >= vocab_size:
        return bits[..., :vocab_size]
    pad = bits.new_zeros(*bits.shape[:-1], vocab_size - bits.shape[-1])
    return torch.cat([bits, pad], dim=-1)


def allowed(words: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
    """bool [B]: whether the CPU bitmask's row ``words[i]`` allows ``token_ids[i]`` (each below W * 32)."""
    picked = words[np.arange(token_ids.size), token_ids >> 5].view(np.uint32)
    return ((picked >> (token_ids & 31).astype(np.uint32)) & 1).astype(bool)


def masked_argmax(logits: np.ndarray, words: np.ndarray, rows: np.ndarray) -> np.ndarray | None:
    """int64 [R]: the argmax of ``logits[rows[i]]`` among the tokens the CPU bitmask row ``words[i]``
    allows (lowest id on ties), read from the words that allow something, so a grammar state that
    allows a few tokens costs a few words of logits, not the row (`sparse_rows` says which rows
    gain). numpy: a few dozen tokens a row are microseconds, where a torch op costs more to call.
    None when a row has no best allowed token (nothing allowed, or NaN logits; or a big-endian host):
    the caller masks those rows whole."""
    vocab, count = logits.shape[1], words.shape[0]
    pair_row, word = np.nonzero(words)  # row-major: a row's words in id order
    starts = np.flatnonzero(np.r_[True, pair_row[1:] != pair_row[:-1]]) if pair_row.size else pair_row
    if starts.size != count or sys.byteorder != "little":
        return None
    bits = np.unpackbits(words[pair_row, word].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")
    ids = word[:, None] * 32 + np.arange(32)  # [P, 32]
    allow = bits.astype(bool) & (ids < vocab)
    values = np.where(allow, logits[rows[pair_row][:, None], np.minimum(ids, vocab - 1)], -np.inf)
    lane = values.argmax(axis=1)  # per word: its best allowed token (the first of equals)
    best = values[np.arange(pair_row.size), lane]
    top = np.maximum.reduceat(best, starts)
    hit = np.flatnonzero((best == np.repeat(top, np.diff(np.r_[starts, pair_row.size]))) & (best > -np.inf))
    first = hit[np.r_[True, pair_row[hit][1:] != pair_row[hit][:-1]]] if hit.size else hit
    if first.size != count:
        return None
    return ids[first, lane[first]]


def refused_out(logits: torch.Tensor, words: np.ndarray, rows: np.ndarray) -> torch.Tensor:
    """float [R, V]: a copy of ``logits[rows]`` with -inf where the CPU bitmask row ``words[i]`` refuses
    the token, written through the words that refuse something: a state that refuses a few tokens
    (inside a JSON string: quotes, controls) costs a copy, not a masking pass."""
    out = logits.index_select(0, torch.from_numpy(rows))
    vocab = out.shape[1]
    pair_row, word = np.nonzero(words != -1)
    bits = (words[pair_row, word].view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    ids = word[:, None] * 32 + np.arange(32)  # [P, 32]
    refused = (bits == 0) & (ids < vocab)
    out.numpy().reshape(-1)[(pair_row[:, None] * vocab + ids)[refused]] = -np.inf
    return out


def sparse_rows(words: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """bool [B] twice, for a CPU bitmask: the rows `masked_argmax` reads (few words allow anything),
    and the rows `refused_out` writes (few words refuse anything), each for less than masking the
    row whole (a word read or written on its own costs about four times its share of a masked row)."""
    return (np.count_nonzero(words, axis=1) * 32 * 4 <= vocab_size,
            np.count_nonzero(words != -1, axis=1) * 32 * 4 <= vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """In place: ``logits[r, j] = -inf`` where token j is not allowed by ``bitmask[r]``.

    ``logits`` [B, V] on any device (the bitmask is copied there); ``rows`` (optional) selects the
    rows of both to mask, leaving the others (unconstrained requests) untouched."""
    if rows is not None:
        rows = torch.as_tensor(rows, dtype=torch.long)
        bitmask = bitmask[rows.to(bitmask.device)]
    allowed = bitmask_to_bool(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        rows = rows.to(logits.device)
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def set_only(bitmask: torch.Tensor, row: int, token_ids: Iterable[int]) -> None:
    """Make ``bitmask[row]`` allow exactly ``token_ids``."""
    bitmask[row].zero_()
    set_bits(bitmask, row, token_ids, True)


def row_words(bitmask: torch.Tensor, row: int):
    """``bitmask[row]`` for reading and writing single words: a numpy view of a CPU row, the tensor's
    row elsewhere. Every constrained row of every step sets its stop bits, and through the view
    set_bits of a few ids takes about a third of the time torch's indexing does."""
    return bitmask.numpy()[row] if bitmask.device.type == "cpu" else bitmask[row]


def bit_is_set(bitmask: torch.Tensor, row: int, token_ids: Iterable[int]) -> bool:
    """True when any of ``token_ids`` is allowed in ``bitmask[row]``."""
    words = row_words(bitmask, row)
    n = words.shape[0]
    return any(t >> 5 < n and (int(words[t >> 5]) >> (t & 31)) & 1 for t in token_ids)


def set_bits_of_rows(bitmask: torch.Tensor, rows: list[int], token_ids: Iterable[int], values: list[bool]) -> None:
    """`set_bits` for many rows of a CPU bitmask at once: the bits of ``token_ids`` in ``bitmask[rows[i]]``
    set where ``values[i]``, cleared elsewhere (one numpy pass a token, not a Python loop a row)."""
    words = bitmask.numpy()
    index, on = np.asarray(rows, dtype=np.int64), np.asarray(values, dtype=bool)
    for t in token_ids:
        w, b = divmod(t, 32)
        if w >= words.shape[1]:
            continue
        bit = np.array(1 << b, dtype=np.uint32).view(np.int32)
        column = words[index, w]
        words[index, w] = np.where(on, column | bit, column & ~bit)


def set_bits(bitmask: torch.Tensor, row: int, token_ids: Iterable[int], value: bool) -> None:
    """Set (value=True) or clear the bits of ``token_ids`` in ``bitmask[row]``."""
    words = row_words(bitmask, row)
    for t in token_ids:
        w, b = divmod(t, 32)
        if w >= words.shape[0]:
            continue
        word = int(words[w]) & 0xFFFFFFFF
        word = word | (1 << b) if value else word & ~(1 << b)
        words[w] = word - (1 << 32) if word >= 1 << 31 else word
