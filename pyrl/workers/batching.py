"""How a worker cuts its rows into work: PPO mini-batches, micro-batches under a token budget (the same count
on every rank), and each micro-batch as the model sees it (`ModelInputs`): packed (remove-padding: the rows'
real tokens end to end, position ids restarting per sequence, attention confined to each sequence) or padded
([rows, columns] with a mask, trimmed of columns that are padding in every row).

Token-level fields (input_ids, position_ids over prompt + response) arrive either padded [B, P + R] with their
attention_mask, or packed: PackedTensors whose layout (pyrl.protocol) replaces the mask, as the trainer sends
them. Response-level fields ([B, R]: responses, masks, advantages, ...) are always padded."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from pyrl.models.varlen_attention import VarlenAttention
from pyrl.protocol import DataProto, PackedLayout, PackedTensor, balanced_partitions, token_budget_micro_batches
from pyrl.workers.distributed import all_reduce

TOKEN_KEYS = ("input_ids", "position_ids")


def require_keys(method: str, data: DataProto, keys) -> None:
    missing = [k for k in keys if k not in data.batch]
    if missing:
        raise KeyError(f"{method}: the batch lacks {missing}; it has {sorted(data.batch)}")


def require_tokens(method: str, data: DataProto, keys=()) -> None:
    """The batch must hold the token fields (padded with attention_mask, or packed) and `keys`."""
    packed = isinstance(data.batch.get("input_ids"), PackedTensor)
    require_keys(method, data, list(TOKEN_KEYS) + ([] if packed else ["attention_mask"]) + list(keys))


def row_lengths(data: DataProto) -> torch.Tensor:
    """Attended (real) tokens of each row: what token budgets count."""
    ids = data.batch["input_ids"]
    return ids.layout.lengths if isinstance(ids, PackedTensor) else data.batch["attention_mask"].sum(-1)


def prompt_groups(data: DataProto) -> tuple[list[list[int]], list[int]]:
    """The rows that share a prompt (the same tokens before the response, left-padded alike), in order of first
    appearance, and each group's token count when its prompt runs once (ModelInputs share_prompts)."""
    ids = data.batch["input_ids"]
    prompt_width = ((ids.layout.width if isinstance(ids, PackedTensor) else ids.shape[1])
                    - data.batch["responses"].shape[1])
    padded = ids.to_padded() if isinstance(ids, PackedTensor) else ids
    mask = ids.layout.mask() if isinstance(ids, PackedTensor) else data.batch["attention_mask"]
    prompt_mask = mask[:, :prompt_width] != 0
    keys = torch.cat([padded[:, :prompt_width] * prompt_mask, prompt_mask.long()], 1)
    _, group_of = torch.unique(keys, dim=0, return_inverse=True)
    groups: dict[int, list[int]] = {}
    for row, group in enumerate(group_of.tolist()):
        groups.setdefault(group, []).append(row)
    lengths, prompt_len = row_lengths(data).tolist(), prompt_mask.sum(-1).tolist()
    members = list(groups.values())
    return members, [sum(lengths[r] for r in rows) - (len(rows) - 1) * prompt_len[rows[0]] for rows in members]


# tokens per micro-batch on a CPU worker whose pass sets no micro-batch size and no token budget (micro_batching)
CPU_TOKEN_BUDGET = 4096


def micro_batching(micro_batch_size: int | None, use_dynamic_bsz: bool, max_token_len: int | None,
                   on_cpu: bool, recut: bool = True) -> tuple[int | None, bool, int | None]:
    """(micro_batch_size, use_dynamic_bsz, max_token_len) as a pass runs them: the config's, except where it sets
    neither a size nor use_dynamic_bsz (verl's defaults). On GPUs the rows then run in one micro-batch; on a CPU
    worker in micro-batches of CPU_TOKEN_BUDGET tokens. The same gradients to rounding (every loss is normalised by
    the mini-batch's tokens, not the micro-batch's); faster: in the trainer's worker one 8,704-token micro-batch of
    bench_e2e's uniform update took 7.2-8.4 s against 5.9-6.6 s in budgets of 2,048-8,192 (benchmarks/RESULTS.md).
    recut=False (a loss that reads statistics of its micro-batch: policy_loss.uses_micro_batch_statistics): as
    configured."""
    if on_cpu and recut and not micro_batch_size and not use_dynamic_bsz:
        return None, True, CPU_TOKEN_BUDGET
    return micro_batch_size, use_dynamic_bsz, max_token_len


def micro_batch_indices(seqlens: torch.Tensor, micro_batch_size: int | None, use_dynamic_bsz: bool,
                        max_token_len: int, device: torch.device, groups=None, recut: bool = True) -> list[list[int]]:
    """Row indices of each micro-batch. Fixed size, or (dynamic) the fewest token-balanced micro-batches of at
    most max_token_len real tokens each (seqlens: the rows' attended token counts). FSDP ranks must run the
    same number of forwards (every forward is a collective), so the count is the maximum over ranks and
    shorter lists are rebalanced to it. groups (prompt_groups' result, for shared prompts): fixed micro-batches
    take the rows group after group, dynamic ones are made of whole groups, counted with their prompt once."""
    rows = int(seqlens.numel())
    defaulted = not micro_batch_size and not use_dynamic_bsz
    micro_batch_size, use_dynamic_bsz, max_token_len = micro_batching(micro_batch_size, use_dynamic_bsz, max_token_len,
                                                                      torch.device(device).type == "cpu", recut)
    quiet = defaulted and use_dynamic_bsz  # the CPU default: a row (or prompt group) over it runs alone, silently
    if not use_dynamic_bsz:
        size = micro_batch_size or rows
        order = [r for members in groups[0] for r in members] if groups else list(range(rows))
        return [order[s:s + size] for s in range(0, rows, size)] or [[]]
    with warnings.catch_warnings():
        if quiet:
            warnings.filterwarnings("ignore", message="token_budget_micro_batches")
        if groups:
            members, tokens = groups
            picked = token_budget_micro_batches(tokens, int(max_token_len), balanced=True)
            batches = [sorted(r for g in batch for r in members[g]) for batch in picked]
        else:
            batches = token_budget_micro_batches(seqlens.tolist(), int(max_token_len), balanced=True)
    count = torch.tensor([len(batches)], dtype=torch.int64, device=device)
    count = int(all_reduce(count, dist.ReduceOp.MAX).item())
    if not rows:  # a rank without rows runs the others' count of empty micro-batches (every forward is a collective)
        return [[] for _ in range(count)] or [[]]
    if count > len(batches):
        batches = [sorted(b) for b in balanced_partitions(seqlens.tolist(), min(count, rows), equal_size=False)]
        batches.sort(key=lambda b: b[0])
        batches += [[] for _ in range(count - len(batches))]
    return batches


def mini_batches(data: DataProto, size: int, epochs: int, shuffle: bool, seed: int, method: str, hint: str = ""):
    """The PPO mini-batches of this rank's rows: `epochs` passes, each in order or reshuffled (seeded), in
    pieces of `size` rows (at most all of them), which must divide the rows."""
    size = min(len(data), max(1, size))
    if len(data) % size:
        raise ValueError(f"{method}: {len(data)} rows per rank is not a multiple of the mini-batch of {size}{hint}")
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(data), generator=generator) if shuffle else torch.arange(len(data))
        for start in range(0, len(data), size):
            yield data.select_idxs(order[start:start + size])


def global_batch_info(response_mask: torch.Tensor, device: torch.device, dp_size: int,
                      loss_mask: torch.Tensor | None = None) -> dict:
    """agg_loss's global_batch_info for a mini-batch, as verl 0.9.1's engine counts it: the valid tokens of
    loss_mask (the response mask before rollout-correction rejection; response_mask where nothing was rejected)
    and the rows, over all ranks. Rejected tokens and empty rows stay in the denominators, as in verl.
    response_tokens and response_rows (pyrl's): the valid tokens of response_mask, over which the metrics' token
    means run, and its rows holding one (the rows verl's old-log-prob pass averages its entropy over)."""
    tokens = loss_mask if loss_mask is not None else response_mask
    counts = all_reduce(torch.tensor([float(tokens.sum()), float(response_mask.shape[0]), float(response_mask.sum()),
                                      float((response_mask.sum(-1) > 0).sum())], dtype=torch.float64, device=device))
    return {"batch_num_tokens": counts[0].item(), "global_batch_size": counts[1].item(), "dp_size": dp_size,
            "response_tokens": counts[2].item(), "response_rows": counts[3].item()}


@dataclass
class ModelInputs:
    """One micro-batch as the model sees it, and where its outputs go.

    input_ids / position_ids: [1, T] packed (T = the rows' real tokens) or [rows, W] padded; attention_mask:
    None (packed: model_kwargs carries the VarlenAttention) or the [rows, W] mask. The model's hidden states,
    flattened to [T or rows x W, H], are read at `score_index`; `labels` are the tokens scored there (the
    responses; zeros when only the states matter, as for a reward model's last token); `scatter` puts the N
    results into a [rows, width] grid (zeros where nothing was scored)."""

    input_ids: torch.Tensor
    attention_mask: object
    position_ids: torch.Tensor
    score_index: torch.Tensor  # [N] int64
    labels: torch.Tensor  # [N] int64
    out_index: torch.Tensor  # [N] int64, flat index into [rows, width]
    rows: int
    width: int
    model_kwargs: dict = field(default_factory=dict)  # packed: the VarlenAttention the attention layers read

    @property
    def num_tokens(self) -> int:
        """Tokens the model runs on (real ones when packed, rows x columns when padded)."""
        return self.input_ids.numel()

    def hidden_states(self, body) -> torch.Tensor:
        """The model body (an HF base model) run on these inputs: its last hidden states. No KV cache (as verl's
        forwards): transformers would otherwise keep every layer's keys and values of the whole batch."""
        return body(input_ids=self.input_ids, attention_mask=self.attention_mask, position_ids=self.position_ids,
                    use_cache=False, **self.model_kwargs).last_hidden_state

    def scored_states(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.reshape(-1, hidden.shape[-1]).index_select(0, self.score_index)

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [rows, width, ...], differentiable; a tensor of its own, not a view (FSDP2 warns that an
        in-place op on a view output would skip its backward hook)."""
        out = values.new_zeros((self.rows, self.width, *values.shape[1:]))
        out.view(self.rows * self.width, *values.shape[1:]).index_copy_(0, self.out_index, values)
        return out

    @classmethod
    def responses(cls, tensors: dict, response_length: int, packed: bool, device: torch.device,
                  share_prompts: bool = False) -> "ModelInputs":
        """Score the last `response_length` columns of [rows, P + R] input_ids (left-padded prompt, right-padded
        response, as a rollout returns them): response token j is predicted by the state before it, as verl.
        Packed, only attended response tokens are scored; padded, every response column is. share_prompts
        (packed only): rows with the same prompt (tokens and positions) run it once (see _share_prompts)."""
        ids, positions = tensors["input_ids"], tensors["position_ids"]
        if isinstance(ids, PackedTensor) and not packed:  # packed transport, padded model: the padded view
            mask = ids.layout.mask()
            ids, positions = ids.to_padded(), positions.to_padded()
        elif isinstance(ids, PackedTensor):
            mask = None
        else:
            mask = tensors["attention_mask"]
        layout = ids.layout if isinstance(ids, PackedTensor) else None
        rows, width = (layout.num_sequences, layout.width) if layout is not None else ids.shape
        if not 0 < response_length < width:
            raise ValueError(f"response_length: expected 1..{width - 1}, got {response_length}")
        prompt_width = width - response_length
        if packed:
            if layout is None:
                layout = PackedLayout.from_mask(mask)
                index = layout.padded_index()
                ids, positions = layout.pack(ids, index), layout.pack(positions, index)
            else:
                ids, positions = ids.values, positions.values
            starts, lengths = layout.starts, layout.lengths
            response_tokens = (starts + lengths - prompt_width).clamp(min=0, max=response_length)
            col = torch.arange(response_length)
            row, col = (col[None, :] < response_tokens[:, None]).nonzero(as_tuple=True)
            token = layout.cu_seqlens[row] + prompt_width + col - starts[row]
            first = token == layout.cu_seqlens[row]
            if bool(first.any()):
                raise ValueError(f"row {int(row[first][0])}: a response token with no prompt token before it has no "
                                 "state to be scored from")
            if share_prompts:
                return cls._share_prompts(ids, positions, layout, lengths - response_tokens, row, col,
                                          response_length, device)
            return cls._packed(ids, positions, layout, token - 1, ids[token], row * response_length + col,
                               response_length, device)
        if share_prompts:
            raise ValueError("share_prompts (actor.use_prefix_grouper) needs the packed path "
                             "(model.use_remove_padding=true)")
        columns = torch.arange(prompt_width - 1, width - 1)
        score = (torch.arange(rows)[:, None] * width + columns[None, :]).reshape(-1)
        return cls(ids.to(device), mask.to(device), positions.to(device), score.to(device),
                   ids[:, prompt_width:].reshape(-1).to(device), torch.arange(rows * response_length, device=device),
                   rows, response_length)

    @classmethod
    def last_tokens(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                    packed: bool, device: torch.device) -> "ModelInputs":
        """Score each row at its last attended token (either padding side), into a [rows, 1] grid."""
        rows, width = input_ids.shape
        has_tokens = (attention_mask != 0).any(-1)
        out = torch.nonzero(has_tokens).reshape(-1)
        if packed:
            layout = PackedLayout.from_mask(attention_mask)
            index = layout.padded_index()
            return cls._packed(layout.pack(input_ids, index), layout.pack(position_ids, index), layout,
                               layout.cu_seqlens[1:][out] - 1, torch.zeros_like(out), out, 1, device)
        columns = torch.arange(width)
        last = (columns * (attention_mask != 0)).argmax(-1)
        return cls(input_ids.to(device), attention_mask.to(device), position_ids.to(device),
                   (out * width + last[out]).to(device), torch.zeros_like(out).to(device), out.to(device), rows, 1)

    @classmethod
    def _share_prompts(cls, ids, positions, layout: PackedLayout, prompt_end, row, col, response_length,
                       device) -> "ModelInputs":
        """Packed rows regrouped so that rows with the same prompt (the tokens before their responses, with
        their positions) hold it once: [prompt, response of row a, response of row b, ...] per prompt, each
        response attending over the prompt and itself (VarlenAttention.from_shared_prefixes). prompt_end [B]:
        each row's prompt length; (row, col): the scored response tokens, as in `responses`."""
        cu = layout.cu_seqlens
        prompt_len = prompt_end.tolist()
        groups: dict = {}
        for r in range(layout.num_sequences):
            begin = int(cu[r])
            key = (tuple(ids[begin:begin + prompt_len[r]].tolist()),
                   tuple(positions[begin:begin + prompt_len[r]].tolist()))
            groups.setdefault(key, []).append(r)
        pieces, prompt_start, response_start = [], {}, torch.zeros(layout.num_sequences, dtype=torch.int64)
        seq_tokens, seq_lengths, seq_owned, at = [], [], [], 0
        for members in groups.values():
            first = members[0]
            prompt = torch.arange(int(cu[first]), int(cu[first]) + prompt_len[first])
            pieces.append(prompt)
            prompt_new = torch.arange(at, at + len(prompt))
            at += len(prompt)
            for i, r in enumerate(members):
                own = torch.arange(int(cu[r]) + prompt_len[r], int(cu[r + 1]))
                pieces.append(own)
                prompt_start[r] = int(prompt_new[0]) if len(prompt_new) else at
                response_start[r] = at
                seq_tokens += [prompt_new, torch.arange(at, at + len(own))]
                seq_lengths.append(len(prompt_new) + len(own))
                seq_owned.append(0 if i == 0 else len(prompt_new))
                at += len(own)
        source = torch.cat(pieces)  # new token -> old token
        attention = VarlenAttention.from_shared_prefixes(torch.cat(seq_tokens), torch.tensor(seq_lengths),
                                                         torch.tensor(seq_owned), device)
        token = response_start[row] + col
        after_prompt = torch.tensor([prompt_start[r] for r in row.tolist()], dtype=torch.int64) + prompt_end[row] - 1
        score = torch.where(col > 0, token - 1, after_prompt)
        new_ids = ids[source]
        return cls(new_ids[None].to(device), None, positions[source][None].to(device), score.to(device),
                   new_ids[token].to(device), (row * response_length + col).to(device), layout.num_sequences,
                   response_length, attention.as_kwargs())

    @classmethod
    def _packed(cls, ids, positions, layout: PackedLayout, score, labels, out, width, device) -> "ModelInputs":
        """ids / positions: [T] packed by `layout`."""
        attention = VarlenAttention.from_lengths(layout.lengths, device)
        return cls(ids[None].to(device), None, positions[None].to(device), score.to(device), labels.to(device),
                   out.to(device), layout.num_sequences, width, attention.as_kwargs())


def trimmed(data: DataProto, response_length: int) -> tuple[dict, int]:
    """A micro-batch's tensors with the columns that are padding in every row cut off (prompt columns on
    the left, response columns on the right); returns (tensors, kept response length >= 1). Packed token
    fields keep their tokens; their layout's columns are trimmed alike."""
    if isinstance(data.batch["input_ids"], PackedTensor):
        return _trimmed_packed(data, response_length)
    mask = data.batch["attention_mask"]
    prompt_width = mask.shape[1] - response_length
    prompt_pad = int((mask[:, :prompt_width].cumsum(-1) == 0).sum(-1).min().item()) if prompt_width else 0
    prompt_pad = min(prompt_pad, prompt_width - 1)
    kept_response = max(1, int(mask[:, prompt_width:].sum(-1).max().item()))
    end = prompt_width + kept_response
    out = {}
    for key, value in data.batch.items():
        if value.dim() == 2 and value.shape[1] == mask.shape[1]:
            out[key] = value[:, prompt_pad:end]
        elif value.dim() >= 2 and value.shape[1] == response_length:  # [B, R] and [B, R, k] (top-k fields)
            out[key] = value[:, :kept_response]
        else:
            out[key] = value
    return out, kept_response


def _trimmed_packed(data: DataProto, response_length: int) -> tuple[dict, int]:
    layout = data.batch["input_ids"].layout
    prompt_width = layout.width - response_length
    kept_response = max(1, int((layout.starts + layout.lengths - prompt_width).max().clamp(min=0)))
    prompt_pad = min(int(layout.starts.min()), prompt_width - 1)
    new_layout = PackedLayout(layout.cu_seqlens, layout.starts - prompt_pad, prompt_width - prompt_pad + kept_response,
                              layout.mask_key, layout.mask_dtype, validate=False)
    out = {}
    for key, value in data.batch.items():
        if isinstance(value, PackedTensor):
            if not value.layout.same_as(layout):
                raise ValueError(f"batch[{key!r}]: packed token fields must share input_ids' layout")
            out[key] = PackedTensor(value.values, new_layout)
        elif value.dim() >= 2 and value.shape[1] == response_length:  # [B, R] and [B, R, k] (top-k fields)
            out[key] = value[:, :kept_response]
        else:
            out[key] = value
    return out, kept_response


def pad_response(values: torch.Tensor, response_length: int) -> torch.Tensor:
    """[b, r, ...] -> [b, response_length, ...], zeros on the right."""
    return torch.nn.functional.pad(values, (0, 0) * (values.dim() - 2) + (0, response_length - values.shape[1]))


def response_forward(data: DataProto, micro_batches, forward) -> tuple:
    """Run forward(tensors, kept_response_length) -> tuple of [b, kept] tensors on each micro-batch (trimmed
    of all-padding columns) and return the outputs as [B, R] CPU tensors in row order. An empty micro-batch
    (a rank with fewer rows than another's micro-batch count) still runs one row for FSDP's collectives."""
    response_length = data.batch["responses"].shape[-1]
    pieces, order = [], []
    for idx in micro_batches:
        tensors, kept = trimmed(data.select_idxs(idx or [0]), response_length)
        outputs = forward(tensors, kept)
        if idx:
            pieces.append([pad_response(out, response_length).cpu() for out in outputs])
            order.extend(idx)
    inverse = np.argsort(np.asarray(order, dtype=np.int64), kind="stable")
    return tuple(torch.cat(column)[inverse] for column in zip(*pieces))
