"""A real megatron-core GPT on one CUDA device, driven through ``get_forward_backward_func``.

Used by the GPU demo mode and the GPU benchmarks (``bench/gpu``): local layer spec (no Transformer
Engine), TP = PP = 1, bf16, Megatron's DDP wrapper and optimizer, synthetic token batches generated on the
device (no dataset download). ``config.timers`` is whatever the caller sets: ``None`` (timing off),
Megatron's own ``Timers``, or this project's shim; the step wraps the optimizer in the same ``optimizer``
timer Megatron's ``training.py`` uses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from typing import Any


@dataclass(frozen=True)
class GPTSize:
    name: str
    hidden: int
    layers: int
    heads: int
    seq: int
    micro_batch: int
    microbatches: int
    vocab: int = 32768


# launch-bound: the host's launches are the critical path (step times: bench/results/gpu-h200.md)
LAUNCH_BOUND = GPTSize("launch-bound", hidden=256, layers=2, heads=4, seq=128, micro_batch=4, microbatches=4)
GPU_BOUND = GPTSize("gpu-bound", hidden=2048, layers=8, heads=16, seq=1024, micro_batch=2, microbatches=8)
# Detection runs: several replicas share one GPU, taking turns step by step. A GPU-bound size (GPU work per
# layer and microbatch several times the host's launch time for it) so device intervals measure GPU work,
# not launch pacing: a launch-bound stage's device time inherits host jitter (bench/gpu/jitter.py,
# bench/results/gpu-h200/jitter.log).
DETECTION = GPTSize("detection", hidden=4096, layers=2, heads=32, seq=1024, micro_batch=4, microbatches=4)
# GPU-bound in every stage on a slow host: the detection shape alone on the GPU. GPU_BOUND's forward pass is paced
# by its launches on the lent H200 VM (forward-compute's device time jitters 11 % there: bench/results/gpu-h200.md
# section 5); this one's kernels are several times their launches, so its step is the GPU's time.
GPU_DENSE = GPTSize("gpu-dense", hidden=4096, layers=2, heads=32, seq=1024, micro_batch=4, microbatches=4)
SIZES = {s.name: s for s in (LAUNCH_BOUND, GPU_BOUND, DETECTION, GPU_DENSE)}


def init_single_process(master_port: int, rank_for_seed: int = 0) -> None:
    """A one-process NCCL world with Megatron's parallel state (TP = PP = 1)."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(master_port)
    torch.cuda.set_device(0)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend="nccl", rank=0, world_size=1)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234 + rank_for_seed)


class MegatronGPT:
    """Model, DDP wrapper, optimizer and a ``train_step`` that runs one Megatron iteration."""

    def __init__(self, size: GPTSize) -> None:
        import torch
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
        from megatron.core.transformer.module import Float16Module
        from megatron.core.transformer.transformer_config import TransformerConfig

        self.size = size
        self.torch = torch
        cfg = TransformerConfig(
            num_layers=size.layers, hidden_size=size.hidden, num_attention_heads=size.heads,
            bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
            use_cpu_initialization=False, hidden_dropout=0.0, attention_dropout=0.0,
        )
        model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                         vocab_size=size.vocab, max_sequence_length=size.seq).cuda()
        model = Float16Module(cfg, model)  # as Megatron's training does for bf16: casts inputs and outputs
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=False,
                                                use_distributed_optimizer=False)
        self.model = DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=model)
        self.config = cfg
        cfg.finalize_model_grads_func = finalize_model_grads
        self.opt_config = OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True, params_dtype=torch.bfloat16,
                                          use_distributed_optimizer=False, clip_grad=1.0)
        self.optimizer = get_megatron_optimizer(self.opt_config, [self.model])
        self.fwd_bwd = get_forward_backward_func()
        dev = torch.device("cuda")
        b, s = size.micro_batch, size.seq
        gen = torch.Generator(device=dev).manual_seed(7)
        self._batches = [
            {
                "tokens": torch.randint(0, size.vocab, (b, s), device=dev, generator=gen),
                "labels": torch.randint(0, size.vocab, (b, s), device=dev, generator=gen),
            }
            for _ in range(4)
        ]
        self._pos = torch.arange(s, device=dev).unsqueeze(0).expand(b, s)
        self._mask = torch.ones(b, 1, s, s, dtype=torch.bool, device=dev).tril_().logical_not_()
        self._loss_mask = torch.ones(b * s, device=dev, dtype=torch.float32)
        self._i = 0

    def set_timers(self, timers: Any) -> None:
        """Megatron reads the model config's and the optimizer config's timers separately."""
        self.config.timers = timers
        self.opt_config.timers = timers
        try:
            self.optimizer.config.timers = timers
        except AttributeError:
            pass

    def _data(self):
        while True:
            self._i += 1
            yield self._batches[self._i % len(self._batches)]

    def _forward_step(self, data_iterator, model):
        # as Megatron-LM's pretrain_gpt.forward_step: the batch fetch is its own level-2 timer, nested in
        # forward-compute
        timers = self.config.timers
        if timers is not None:
            timers("batch-generator", log_level=2).start()
        data = next(data_iterator)
        if timers is not None:
            timers("batch-generator").stop()
        out = model(data["tokens"], self._pos, self._mask, labels=data["labels"])

        def loss_func(output_tensor):
            losses = output_tensor.float().view(-1)
            loss = (losses * self._loss_mask).sum() / self._loss_mask.sum()
            return loss, {"lm loss": loss.detach()}

        return out, partial(loss_func)

    def train_step(self) -> None:
        """One iteration as Megatron's ``train_step`` runs it (minus logging)."""
        timers = self.config.timers
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.fwd_bwd(forward_step_func=self._forward_step, data_iterator=self._data(), model=[self.model],
                     num_microbatches=self.size.microbatches, seq_length=self.size.seq,
                     micro_batch_size=self.size.micro_batch, decoder_seq_length=self.size.seq,
                     forward_only=False)
        if timers is not None:
            timers("optimizer", log_level=1).start(barrier=False)
        self.optimizer.step()
        if timers is not None:
            timers("optimizer").stop()
