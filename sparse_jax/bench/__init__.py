"""The measuring tools, apart from the library: each benchmark driver runs its cases one after
another, most of them each in a fresh process, and writes tables and JSON.

  tools        process isolation with peak memory, timing after compile, the matmul ceiling,
               the machine, console lines and a progress bar, tables and a plot (also used by
               `sparse_jax.bench.pattern_study`)
  attention    block-sparse against dense attention          scripts/benchmark_attention.py
  model        a model's training step; compile time         scripts/benchmark_model.py
  sampling     cached sampling; evaluation throughput        scripts/benchmark_sampling.py
  training     the trainer against a PyTorch eager twin      scripts/benchmark_training.py
  torch_twin   that twin (needs torch: requirements-bench.txt)
  pattern_study, long_study   whole trainings per pattern or context, for equal steps or time
                                             scripts/compare_patterns.py, accelerator_report.py
  accelerator/ the accelerator report, a module per stage      scripts/accelerator_report.py
  compiled*    GPU and TPU programs compiled and costed on a CPU   scripts/compile_report.py
  cost_model   the compile report's figures calibrated on measured GPU rows
                                             scripts/cost_model.py
  context_costs  what context parallelism sends and plans    scripts/context_parallel.py

A case's process is `python -m sparse_jax.bench.MODULE CASE_JSON` (attention, model,
training). Nothing here imports JAX (or torch) at import time: a case sets up its devices first.
"""
