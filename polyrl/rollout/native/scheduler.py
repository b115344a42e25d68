"""Continuous batching: which sequences run in the next forward, and where their K/V goes.

Each step is either a prefill step (prompt chunks, at most `max_num_batched_tokens` tokens; prefill first, as in
vLLM v0) or a decode step (one token for every running, prefilled sequence). At most `max_num_seqs` sequences run at
once. While others decode, waiting prompts join in batches: once an eighth of the seats (or all the waiting need) are
free. A prefill step is an eager forward of all the weights; admitting each prompt as soon as one seat freed made
one such step per prompt (partial rollouts send n=1 rows: on an H100 their generation took 23.9 s before this and the
auto `max_num_seqs`, 14.0 s after).

Prompt sharing: a prompt with n samples is admitted as one sequence that is prefilled once; the step that finishes its
prefill forks it into n sequences that share the full prompt blocks (refcount n) and each own a copy of the partial
last block (copied on device right after that forward). All n draw their first token from the same logits row.

The engine runs one step ahead of the host: tokens sampled in step t are fed to step t+1 on the device, and the host
reads them while step t+1 runs. So `length` counts tokens that exist on the device, `tokens` those the host has seen.
Length limits are known up front (a sequence leaves `running` when its last token is scheduled); a stop token is seen
one step late, costing one wasted row. Out of blocks: drain the pipeline, then preempt the newest sequence (free its
blocks, recompute it later from its tokens, as vLLM's recompute preemption).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from polyrl.rollout.native.block_manager import BlockManager


@dataclass(eq=False)
class Sequence:
    row: int  # output row (prompt-major: prompt_index * n + sample)
    prompt_index: int
    tokens: list[int]  # prompt, then generated tokens as the host learns them
    num_prompt: int
    max_new: int
    n: int = 1  # samples this sequence forks into when its prefill completes (1 after the fork)
    length: int = 0  # tokens that exist (on device), >= len(tokens)
    num_cached: int = 0  # leading tokens whose K/V is in the cache
    prefilled: bool = False
    blocks: list[int] = field(default_factory=list)
    fork_blocks: list[int] = field(default_factory=list)  # reserved copies of the partial last prompt block
    slot: int = -1  # row in the device token buffer and block table
    logprobs: list[float] = field(default_factory=list)
    done_scheduling: bool = False
    finish_reason: str | None = None
    resumed: bool = False  # continues on a KV cache kept from an earlier call (engine.py `_resume_kept`)

    def __post_init__(self):
        self.length = len(self.tokens)


@dataclass
class Step:
    decode: bool
    seqs: list[Sequence]  # forward order
    chunks: list[tuple[int, int]]  # per seq: (start position, number of tokens) of this forward
    sample_seqs: list[Sequence] = field(default_factory=list)  # who gets a sampled token, sampler-row order
    sample_src: list[int] = field(default_factory=list)  # per sample row: index into seqs whose last row feeds it
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src block, dst block) after the forward
    retired: list[Sequence] = field(default_factory=list)  # last token scheduled here: free after launch


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_blocks_per_seq: int, forced_max_new: Callable[[int], int]):
        self.bm = blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_new_for_row = forced_max_new
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.table_updates: list[tuple[int, int, int]] = []  # (slot, column, block) for the device block table
        self.drain: Callable[[], None] = lambda: None  # set by the engine: finish the step in flight
        self.num_preempted = 0
        self.watermark = max(1, self.bm.num_blocks // 100)
        self.admit_batch = max(1, max_num_seqs // 8)  # seats that must be free before prompts join running rows
        # partial rollouts: whether a row retired at its length limit keeps its blocks (parked), by row
        self.keep_at_limit: Callable[[int], bool] = lambda row: False
        self.park_on_stop = False  # multi-turn: a row that emitted a stop token keeps its blocks too
        self.parked: set[Sequence] = set()
        self.on_retire: Callable[[Sequence], None] | None = None  # the engine's routing record (before blocks go)

    # ---- bookkeeping -------------------------------------------------------------------------------------------
    def _set_blocks(self, seq: Sequence, start: int = 0) -> None:
        for col in range(start, len(seq.blocks)):
            self.table_updates.append((seq.slot, col, seq.blocks[col]))

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = self.bm.blocks_for(num_tokens) - len(seq.blocks)
        if need <= 0:
            return True
        if need > self.bm.num_free:
            return False
        start = len(seq.blocks)
        seq.blocks += self.bm.allocate(need)
        self._set_blocks(seq, start)
        return True

    def retire(self, seq: Sequence, park: bool = False) -> None:
        """Free a sequence's blocks and seat (after its last forward was launched; the stream orders reuse). `park`:
        keep its blocks (the engine decides once the last token is known: engine.py `_keep`)."""
        if self.on_retire is not None:
            self.on_retire(seq)
        if seq in self.running:
            self.running.remove(seq)
        if park:
            self.parked.add(seq)
        else:
            self.bm.release(seq.blocks)
        self.bm.release(seq.fork_blocks)
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
            seq.slot = -1

    def _preempt(self, victim: Sequence) -> None:
        self.retire(victim)
        victim.num_cached, victim.prefilled, victim.resumed = 0, False, False
        self.waiting.appendleft(victim)
        self.num_preempted += 1

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----------------------------------------------------------------------------------------------
    def schedule(self) -> Step | None:
        step = self._schedule_prefill()
        if step is not None:
            return step
        return self._schedule_decode()

    def _schedule_prefill(self) -> Step | None:
        budget = self.max_num_batched_tokens
        seqs, chunks = [], []
        unfinished = [s for s in self.running if not s.prefilled]
        # rows resuming on a kept cache feed one token each over long contexts: a step of their own, so the padded
        # prefill attention ([rows, queries, context]) stays one query wide
        alone = any(s.resumed for s in unfinished)
        for seq in unfinished:  # unfinished chunked prefills first
            if budget > 0 and seq.resumed == alone:
                c = min(seq.length - seq.num_cached, budget)
                seqs.append(seq), chunks.append((seq.num_cached, c))
                budget -= c
        admit = bool(self.waiting) and not alone and self._may_admit()  # decided once: then fill every free seat
        while self.waiting and budget > 0 and admit:
            seq = self.waiting[0]
            if sum(s.n for s in self.running) + seq.n > self.max_num_seqs:  # an unforked prompt holds n seats
                break
            partial = seq.length % self.bm.block_size != 0
            need = self.bm.blocks_for(seq.length) + (seq.n - 1 if partial else 0)
            reserve = self.watermark if self.running else 0
            if need + reserve > self.bm.num_free:
                break
            self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            seq.blocks = self.bm.allocate(self.bm.blocks_for(seq.length))
            seq.fork_blocks = self.bm.allocate(seq.n - 1) if partial else []
            self._set_blocks(seq)
            self.running.append(seq)
            c = min(seq.length, budget)
            seqs.append(seq), chunks.append((0, c))
            budget -= c
        if not seqs:
            return None
        step = Step(decode=False, seqs=seqs, chunks=chunks)
        for i, (seq, (start, c)) in enumerate(zip(seqs, chunks)):
            seq.num_cached = start + c
            if seq.num_cached == seq.length:
                seq.prefilled, seq.resumed = True, False
                for s in [seq] + self._fork(seq, step):
                    step.sample_seqs.append(s), step.sample_src.append(i)
        self._after_sampling(step)
        return step

    def _may_admit(self) -> bool:
        """Whether waiting prompts may join now: always when nothing decodes, else once `admit_batch` seats (or as
        many as all the waiting prompts need) are free, so that one prefill step admits many rows."""
        if not self.running:
            return True
        free = self.max_num_seqs - sum(s.n for s in self.running)
        if free >= self.admit_batch:
            return True
        need = 0  # all the waiting prompts fit: summed only until they do not
        for seq in self.waiting:
            need += seq.n
            if need > free:
                return False
        return True

    def _fork(self, parent: Sequence, step: Step) -> list[Sequence]:
        if parent.n == 1:
            return []
        bs = self.bm.block_size
        full = parent.blocks[: parent.length // bs]
        children = []
        for j in range(1, parent.n):
            row = parent.prompt_index * parent.n + j
            child = Sequence(row=row, prompt_index=parent.prompt_index, tokens=list(parent.tokens),
                             num_prompt=parent.num_prompt, max_new=self.max_new_for_row(row))
            child.num_cached, child.prefilled = parent.num_cached, True
            child.blocks = self.bm.share(full)
            if parent.fork_blocks:
                dst = parent.fork_blocks.pop()
                child.blocks.append(dst)
                step.copies.append((parent.blocks[-1], dst))
            child.slot = self.free_slots.pop()
            self._set_blocks(child)
            children.append(child)
        idx = self.running.index(parent) + 1
        self.running[idx:idx] = children
        parent.n = 1
        return children

    def _schedule_decode(self) -> Step | None:
        batch = [s for s in self.running if s.prefilled]
        i = 0
        while i < len(batch):
            seq = batch[i]
            if self._grow(seq, seq.length):
                i += 1
                continue
            self.drain()  # the host must know every token of a victim before it can be recomputed
            batch = [s for s in self.running if s.prefilled]
            if seq not in batch:
                continue
            if self._grow(seq, seq.length):
                continue
            victim = self.running[-1]
            self._preempt(victim)
            batch = [s for s in self.running if s.prefilled]
            i = min(i, len(batch))
        if not batch:
            return None
        step = Step(decode=True, seqs=batch, chunks=[(s.length - 1, 1) for s in batch])
        step.sample_seqs, step.sample_src = list(batch), list(range(len(batch)))
        for s in batch:
            s.num_cached = s.length
        self._after_sampling(step)
        return step

    def _after_sampling(self, step: Step) -> None:
        for s in step.sample_seqs:
            s.length += 1
            if s.length - s.num_prompt >= s.max_new:
                s.done_scheduling = True
                step.retired.append(s)
                self.running.remove(s)
