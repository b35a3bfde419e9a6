"""`InputBatch`: one row per running request, kept across steps (vLLM v1's persistent batch).

Token ids, block tables and sampling settings live in numpy arrays indexed by row. A request gets a
row when it enters the batch (new, resumed or forked) and keeps it until it finishes or is preempted;
each step only appends what changed (new blocks, the tokens just drawn). The row is also the request's
processor-state slot on the device. A step's inputs are gathered from the rows with numpy.
"""

from __future__ import annotations

import numpy as np

from jaxpaged.request import Request

MAX_INT32 = 2**31 - 1


class InputBatch:
    """Rows of running requests. R = max_num_seqs rows, L = max_model_len, W = block-table width."""

    def __init__(self, num_rows: int, max_model_len: int, table_width: int):
        self.num_rows = num_rows
        self.token_ids = np.zeros((num_rows, max_model_len), np.int32)  # [R, L]; zeros are lazily committed
        self.num_known = np.zeros(num_rows, np.int32)  # [R] tokens of the row written into token_ids
        self.prompt_len = np.zeros(num_rows, np.int32)
        self.block_table = np.zeros((num_rows, table_width), np.int32)  # [R, W]; 0 = the null block
        self.num_blocks = np.zeros(num_rows, np.int32)
        self.generation = np.zeros(num_rows, np.int64)  # bumped whenever a row changes hands
        # sampling settings
        self.temperature = np.zeros(num_rows, np.float32)
        self.top_k = np.zeros(num_rows, np.int32)
        self.top_p = np.ones(num_rows, np.float32)
        self.seed = np.zeros(num_rows, np.uint32)
        self.num_logprobs = np.full(num_rows, -1, np.int32)
        self.prompt_logprobs = np.zeros(num_rows, bool)
        self.repetition_penalty = np.ones(num_rows, np.float32)
        self.presence_penalty = np.zeros(num_rows, np.float32)
        self.frequency_penalty = np.zeros(num_rows, np.float32)
        self.min_p = np.zeros(num_rows, np.float32)
        self.use_bias = np.zeros(num_rows, bool)
        self.min_tokens = np.zeros(num_rows, np.int32)
        self.held = np.zeros(num_rows, bool)  # a beam: its owner appends each token, not the runner
        self.lora_slot = np.full(num_rows, -1, np.int32)  # the slot of the device's LoRA stack it runs with; -1: none
        self.requests: list[Request | None] = [None] * num_rows
        self.row_of: dict[str, int] = {}
        self._free = list(range(num_rows - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.row_of)

    def add(self, req: Request, block_ids: list[int]) -> int:
        """Give `req` a row: its known tokens, block table and sampling settings. Returns the row."""
        if req.request_id in self.row_of:
            raise ValueError(f"request {req.request_id!r} already has a row")
        row = self._free.pop()
        self.row_of[req.request_id] = row
        self.requests[row] = req
        req.batch_row = row
        self.generation[row] += 1
        tokens = req.prompt_token_ids + req.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_known[row] = len(tokens)
        self.prompt_len[row] = len(req.prompt_token_ids)
        self.set_blocks(row, block_ids)
        p = req.sampling_params
        self.temperature[row], self.top_p[row] = p.temperature, p.top_p
        self.top_k[row] = min(p.top_k, MAX_INT32)  # (k past the vocabulary keeps every token)
        self.seed[row] = req.seed
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.prompt_logprobs[row] = p.prompt_logprobs is not None
        self.repetition_penalty[row], self.presence_penalty[row] = p.repetition_penalty, p.presence_penalty
        self.frequency_penalty[row], self.min_p[row] = p.frequency_penalty, p.min_p
        self.use_bias[row] = p.needs_bias_row
        self.min_tokens[row] = min(p.min_tokens, MAX_INT32)  # (past the context: EOS never before its end)
        self.held[row] = req.hold_output
        self.lora_slot[row] = req.lora_slot
        return row

    def remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.requests[row].batch_row = -1
            self.requests[row] = None
            self.generation[row] += 1
            self._free.append(row)

    def set_blocks(self, row: int, block_ids: list[int]) -> None:
        n = len(block_ids)
        self.block_table[row, :n] = block_ids
        self.block_table[row, n:] = 0
        self.num_blocks[row] = n

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        n = int(self.num_blocks[row])
        self.block_table[row, n : n + len(block_ids)] = block_ids
        self.num_blocks[row] = n + len(block_ids)

    def refresh_tokens(self, row: int) -> None:
        """Copy tokens the request gained outside the runner (a beam's owner appends them)."""
        req = self.requests[row]
        known = int(self.num_known[row])
        if req.num_tokens > known:
            self.token_ids[row, known : req.num_tokens] = req.token_ids_slice(known, req.num_tokens)
            self.num_known[row] = req.num_tokens

    def record_tokens(self, rows: np.ndarray, positions: np.ndarray, tokens: np.ndarray,
                      generations: np.ndarray) -> None:
        """Write drawn tokens at their positions, for rows that still belong to the request that drew them."""
        mine = self.generation[rows] == generations
        rows, positions, tokens = rows[mine], positions[mine], tokens[mine]
        self.token_ids[rows, positions] = tokens
        self.num_known[rows] = np.maximum(self.num_known[rows], positions + 1)
