"""The trainers of the app layer, one family split at its seams (not a public API; `batchd.testing`
re-exports what tests need):

- `models`: the one `build_model` (the reference tiny causal LM, the bench's ~110M Llama-style preset, the
  tiny multimodal ones: `TinyMLLM` and the stock HF Qwen2-VL) and the vision tower's timer;
- `failure`: what a trainer does when a step raised (`FailureWatch`, `raise_job_failure`);
- `args`, `strategy`, `checkpoint`, `loop`: the reference trainer `python -m batchd.train` (its flags, its
  process group and data parallelism, its checkpoints, its batchd loop); `batchd/train.py` is its entry;
- `demo`: one rank of `batchd demo` and the end-to-end tests (`python -m batchd._train.demo`): the batchd
  loop beside the fixed-batch baselines;
- `bench`, `bench_data`: one rank of `batchd bench` (`python -m batchd._train.bench`): every system's data
  path (fixed, ODB, batchd) under one timed loop.

Nothing here is imported by the daemons (`batchd coordinator`, `batchd rank`, `batchd node`).
"""
