"""What every run reads and writes in its workdir, below the tasks that run (``train``,
``evaluate``, ``sample``): ``setup`` (a run's config completed and checked in one place),
``config`` (checks and the workdir's record of the config), ``optim`` (the optimizer and the
training state), ``sizing`` (what a config costs, allocating nothing), ``checkpoints`` and
``workdir`` (what a workdir may hold, its lock)."""
