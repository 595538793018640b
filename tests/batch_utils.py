"""Drives a ModelRunner directly with hand-made batches (rows, slots, plans), as the scheduler would."""

from __future__ import annotations

import torch

from radixlm.runtime.executor.forward_batch import BatchPlan, ForwardMode


class ManualBatches:
    def __init__(self, runner):
        self.runner = runner
        self.rows: list[int] = []
        self.slots: list[torch.Tensor] = []

    def new_seq(self, shared_from: int | None = None, shared_len: int = 0) -> int:
        """A table row; its first `shared_len` positions reuse the slots of sequence `shared_from`."""
        row = self.runner.req_to_token.alloc()
        self.rows.append(row)
        own = torch.empty(0, dtype=torch.int64)
        if shared_from is not None:
            own = self.slots[shared_from][:shared_len].clone()
        self.runner.req_to_token.write(row, 0, own)
        self.slots.append(own)
        return len(self.rows) - 1

    def forward(self, mode: ForwardMode, items: list[tuple[int, list[int]]], logits: str = "all") -> torch.Tensor:
        """Runs the new tokens of each (seq, tokens) after what the seq holds; logits of every new token
        ('all') or of each seq's last token ('last')."""
        ids, new, rows, prefix, lens, logit_idx = [], [], [], [], [], []
        for seq, tokens in items:
            start = self.slots[seq].numel()
            got = self.runner.allocator.alloc(len(tokens))
            self.runner.req_to_token.write(self.rows[seq], start, got, mirror=False)
            self.slots[seq] = torch.cat([self.slots[seq], got])
            ids += tokens
            new.append(got)
            rows.append(self.rows[seq])
            prefix.append(start)
            lens.append(len(tokens))
            logit_idx += range(len(ids) - len(tokens), len(ids)) if logits == "all" else [len(ids) - 1]
        plan = BatchPlan(mode, ids, torch.cat(new), rows, prefix, lens, logit_idx)
        self.last_batch = self.runner.make_batch(plan)
        return self.runner.forward(self.last_batch)

    def release(self) -> None:
        owned = {}
        for s in self.slots:
            for x in s.tolist():
                owned[x] = None
        self.runner.allocator.free(torch.tensor(list(owned), dtype=torch.int64))
        for r in self.rows:
            self.runner.req_to_token.free(r)
        self.rows, self.slots = [], []
