"""One pass of Megatron's pipeline schedule over packed micro-batches: forward (+ backward) and per-token outputs.

`run_schedule` lays `PackedBatch` micro-batches out as THD micro-batches of one common length, calls Megatron's
`get_forward_backward_func()` (no pipelining, 1F1B or interleaved, chosen by Megatron from the parallel state),
and on the last pipeline stage computes per-token logprobs/entropy with `logprobs.vocab_parallel_logprobs`
and hands them to a per-micro-batch callback (the algorithm's loss in training, a collector for
`compute_logprobs`).

Loss scaling. The model config has `calculate_per_token_loss=True`, so Megatron neither divides a
micro-batch's loss by the number of micro-batches nor the DP gradients by the DP size, and the
`finalize_model_grads_func` installed by the trainer does not divide by a token count: the gradient is that of
the *sum* of the callbacks' losses over micro-batches and DP ranks, which is what the loss contract of
`beamrl.trainer.protocol` promises.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from beamrl.trainer.megatron.batch import ThdMicroBatch, common_length, to_thd
from beamrl.trainer.megatron.logprobs import vocab_parallel_logprobs
from beamrl.trainer.protocol import PackedBatch

#: Callback on the last stage: (packed logprobs [T], packed entropy [T] | None, micro-batch) ->
#: (loss scalar with grad (a 0 tensor in forward-only), dict of tensors to collect).
OutputFn = Callable[[torch.Tensor, torch.Tensor | None, PackedBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class LogitsSpec:
    """How to turn the model's output into logprobs: temperature, the softcap still to apply (None when the
    model applies it), the TP group and this rank's first vocabulary id."""

    temperature: float
    softcap: float | None
    tp_group: object
    vocab_start: int
    return_entropy: bool = True


@dataclass
class MicroBatch:
    """A THD micro-batch plus its per-forward state (replay routes, routing record)."""

    thd: ThdMicroBatch
    device: torch.device
    replay: bool = False
    record: bool = False
    #: Filled by the MoE layers when `record`: {global layer: ids [T_local, k]} over this rank's chunks.
    recorded: dict = field(default_factory=dict)

    @property
    def source(self) -> PackedBatch:
        return self.thd.source

    def packed_seq_params(self):
        from beamrl.trainer.megatron.model.batch import packed_seq_params

        params = packed_seq_params(self.thd.cu_seqlens.to(self.device),
                                   routes=self.thd.routes.to(self.device) if self.replay else None,
                                   record=self.record)
        params.recorded = self.recorded  # shared by every chunk's forward of this micro-batch
        return params


def prepare(micro_batches: list[PackedBatch], seq_multiple: int, device: torch.device, num_layers: int,
            replay: bool = False, record: bool = False) -> tuple[list[MicroBatch], int]:
    """Pad every micro-batch to one common length (a multiple of `seq_multiple`, e.g. TP with SP)."""
    if replay:
        missing = [i for i, mb in enumerate(micro_batches) if mb.routes is None]
        if missing:
            raise ValueError(f"routing replay is on but micro-batches {missing} have no routes (PackedBatch.routes)")
    length = common_length(micro_batches, seq_multiple)
    return [MicroBatch(to_thd(mb, length, num_layers), device, replay, record) for mb in micro_batches], length


def _forward_step(spec: LogitsSpec, output_fn: OutputFn, data_iterator, model):
    mb: MicroBatch = next(data_iterator)
    tokens = mb.thd.tokens.to(mb.device)
    output = model(input_ids=tokens, position_ids=None, attention_mask=None,
                   packed_seq_params=mb.packed_seq_params())
    return output, partial(_loss_func, spec, output_fn, mb)


def _loss_func(spec: LogitsSpec, output_fn: OutputFn, mb: MicroBatch, logits: torch.Tensor):
    """Last stage: logits [1, length, V/tp] -> packed per-token logprobs -> the callback's loss."""
    targets = mb.thd.next_token_targets().to(logits.device)
    lp, ent = vocab_parallel_logprobs(logits, targets, spec.temperature, spec.softcap, spec.tp_group,
                                      spec.vocab_start, spec.return_entropy)
    lp = mb.thd.to_tokens(lp)
    ent = None if ent is None else mb.thd.to_tokens(ent)
    loss, collected = output_fn(lp, ent, mb.source.to(lp.device))
    if not torch.is_tensor(loss) or loss.dim() != 0:
        raise TypeError(f"the loss function must return a scalar tensor as its loss, got {type(loss).__name__} "
                        f"{getattr(loss, 'shape', '')}")
    return loss, torch.tensor(mb.source.num_loss_tokens, dtype=torch.int), collected


def run_schedule(chunks: list, micro_batches: list[MicroBatch], length: int, spec: LogitsSpec,
                 output_fn: OutputFn, forward_only: bool) -> list[dict[str, torch.Tensor]]:
    """Run Megatron's schedule; returns the callbacks' collected dicts (last pipeline stage only, else [])."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    # Each model chunk pulls every micro-batch once, from its own iterator (interleaved schedule contract).
    iterators = [iter(micro_batches) for _ in chunks]
    forward_backward = get_forward_backward_func()
    return forward_backward(
        forward_step_func=partial(_forward_step, spec, output_fn),
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(micro_batches),
        seq_length=length,
        micro_batch_size=1,
        forward_only=forward_only,
    )
