"""A stock HF multimodal model trained by `BatchdTrainer` (transformers.Trainer) through batchd.

The tiny Qwen2-VL (`batchd._vlm_tiny`, random weights, fp32) is adapted by `batchd.two_phase` and trained
by `BatchdTrainer` on batches of a real in-process coordinator and rank service (gRPC on loopback) whose
samples are demo records run through the model's own processor (`HFProcessor`: chat template, image
processor, mm_token_type_ids). World size 1, padded and packed rows: one epoch, every id exactly once, and
the first optimizer step's gradient equals the stock model's, called the HF way on each sample alone
(per-token mean over the step's loss tokens); a per-sample-mean control differs. The multi-rank (DDP,
two-phase exchange) proofs are in tests/test_hf_vlm.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _jobs import job_pool
from test_hf_vlm import sample_loss  # the stock model called the HF way on one sample

from batchd import two_phase
from batchd.client import loss_tokens
from batchd.core import JobSpec, PolicySpec
from batchd.service.preprocess import HFProcessor, Preprocessor, SyntheticData, SyntheticSource, Truncate
from batchd.testing import demo_record, parse_record, tiny_processor, tiny_vlm

transformers = pytest.importorskip("transformers")

N = 24
ATOL = 2e-5


class PayloadSource(SyntheticSource):
    """A rank's view over given payloads and their metadata (image patches and tokens)."""

    def __init__(self, payloads, metas, rank: int, world_size: int, seed: int) -> None:
        lengths = [len(p["input_ids"]) for p in payloads]
        super().__init__(SyntheticData(lengths, images=[m.images for m in metas]), rank, world_size, seed)
        self.payloads = payloads

    def materialize(self, sample_id: int):
        if not 0 <= sample_id < len(self.payloads):
            raise KeyError(f"sample {sample_id} is not in this dataset of {len(self.payloads)} samples")
        return self.payloads[sample_id]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2vl_proc")
    proc = tiny_processor("qwen2_vl")
    proc.save_pretrained(path)
    pre = Preprocessor([HFProcessor(path), Truncate(2048)])
    out = [
        pre(parse_record(demo_record(i, seed=4, image_fraction=0.5, max_image_side=96)), i, 0)
        for i in range(N)
    ]
    metas, payloads = [m for m, _ in out], [p for _, p in out]
    assert sum(1 for m in metas if m.images) >= 6 and sum(1 for m in metas if not m.images) >= 4
    return proc.tokenizer, metas, payloads


def reference_grad(model, payloads, per_sample_mean: bool = False) -> torch.Tensor:
    """The stock model's gradient of the per-token mean loss over `payloads`, each forwarded alone."""
    model = copy.deepcopy(model)
    sums = [sample_loss(model, p) for p in payloads]
    counts = [loss_tokens(p["labels"]) for p in payloads]
    loss = (
        torch.stack([s / n for s, n in zip(sums, counts, strict=False)]).mean()
        if per_sample_mean
        else torch.stack(sums).sum() / sum(counts)
    )
    loss.backward()
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in model.parameters()]
    )


class FirstGrads(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if not self.grads:
            self.grads.append(torch.cat([p.grad.detach().reshape(-1) for p in model.parameters()]))


@pytest.mark.parametrize("collate", ["padded", "packed"])
def test_batchd_trainer_trains_a_stock_qwen2_vl(data, tmp_path, collate):
    from batchd.client import BatchdTrainer

    tok, metas, payloads = data
    stock = tiny_vlm("qwen2_vl", tok, seed=0)
    model = two_phase(copy.deepcopy(stock))
    seen = []

    class Recording(BatchdTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            seen.append(inputs["sample_ids"].tolist())
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    spec = JobSpec(
        world_size=1,
        token_budget=1024,
        seed=3,
        policy=PolicySpec(name="balanced", window=8, depth=2, collate=collate),
    )
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=1000,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_pin_memory=False,
    )
    grads = FirstGrads()
    with job_pool() as start:
        job = start(spec, sources=[PayloadSource(payloads, metas, 0, 1, spec.seed)])
        trainer = Recording(model=model, args=args, client=lambda: job.client(0), callbacks=[grads])
        out = trainer.train()
    ids = [i for step in seen for i in step]
    assert sorted(ids) == list(range(N)), "every sample exactly once"
    assert out.global_step == len(seen) > 2
    first = [payloads[i] for i in seen[0]]
    assert len(first) > 1 and any("pixel_values" in p for p in first), (
        "the first step mixes samples and images"
    )
    want = reference_grad(stock, first)
    err = float((grads.grads[0] - want).abs().max())
    assert err <= ATOL, err
    control = reference_grad(stock, first, per_sample_mean=True)
    assert float((control - want).abs().max()) > 100 * ATOL, "the control must differ"
